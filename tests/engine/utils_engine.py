"""Helpers for engine tests (imported by the test modules; fixtures live in conftest.py)."""

from __future__ import annotations

import torch

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.stage_engine import LLMEngine
from omnistage.models.loader import LoadedModel
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams

# Prompts of different lengths (a few tokens to several blocks of 16).
PROMPTS = [
    "hello world!",
    "the quick brown fox jumps over the lazy dog. what is the capital of france?",
    "one two three",
    "a small model reads a short prompt and writes a short answer. images, audio and video go in; "
    "text and speech come out. def main(): return 0",
]



def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """``generate``'s greedy tokens, exactly ``max_new_tokens`` of them; ``generate_kwargs``
    add its logits processors (``repetition_penalty``, ``suppress_tokens``, ...)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **generate_kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


def make_engine(loaded: LoadedModel, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(model=loaded.model_path, **kwargs), loaded_model=loaded)


def run_all(
    engine: LLMEngine, prompts: list, params: SamplingParams | list[SamplingParams], prefix: str = ""
) -> list[RequestOutput]:
    """Add every prompt, step to completion, return final outputs in order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{prefix}{i}", p, sp)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]


def assert_pool_clean(engine: LLMEngine) -> None:
    """No KV block is referenced and every block is free again."""
    kv = engine.scheduler.kv_cache_manager
    # No request is left (the engine may still owe one step that drops ended batch rows).
    assert not engine.scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.req_to_blocks
    assert not engine.runner._parked_generators and not engine.output_processor.states
    stats = engine.get_stats()
    assert stats.kv_blocks_used == 0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
