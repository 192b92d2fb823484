"""``make demo``: a two-turn chat with the embedded default model.

Shows a real answer per turn and, on the second turn, the KV prefix cache at
work: the first turn's prompt and answer are served from cached blocks, so
only the new user message is computed before the first token.
"""

from __future__ import annotations

import sys
import time

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.stage_engine import LLMEngine
from omnistage.entrypoints.cli import stream_answer
from omnistage.sampling_params import SamplingParams

TURNS = [
    "What is the capital of France? Answer in one sentence.",
    "Name one famous landmark in that city, in one sentence.",
]


def main() -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the demo's output to the conversation
    start = time.monotonic()
    engine = LLMEngine(EngineArgs())
    print(f"omnistage demo: {engine.loaded_model.name} on {engine.args.device}, "
          f"loaded in {time.monotonic() - start:.1f} s\n")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=48)
    messages: list[dict[str, str]] = []
    for turn, question in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": question})
        print(f"[turn {turn}] user: {question}")
        sys.stdout.write("assistant: ")
        t0 = time.monotonic()
        out = stream_answer(engine, f"turn-{turn}", engine.encode_chat(messages), params, sys.stdout)
        elapsed = time.monotonic() - t0
        answer = out.outputs[0]
        messages.append({"role": "assistant", "content": answer.text})
        num_prompt = len(out.prompt_token_ids)
        ttft = out.metrics.time_to_first_token or 0.0
        print(
            f"  prompt tokens: {num_prompt}, served from the prefix cache: {out.num_cached_tokens} "
            f"({out.num_cached_tokens / num_prompt:.0%}); TTFT {ttft * 1000:.0f} ms; "
            f"{len(answer.token_ids)} tokens in {elapsed:.1f} s\n"
        )
    stats = engine.get_stats()
    print(f"prefix cache: {stats.prefix_cache_hit_tokens}/{stats.prefix_cache_query_tokens} prompt tokens hit "
          f"({stats.prefix_cache_hit_rate:.0%}) over {len(TURNS)} turns")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
