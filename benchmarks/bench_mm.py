"""What the encoder cache and the KV prefix cache buy a multimodal model.

A tiny Qwen2.5-VL checkpoint sized so that the vision tower dominates (a
wider, deeper vision encoder than the test checkpoint, images of up to 1,024
merged tokens = 4,096 patches), fp32, in one process:

1. time to first token of a request whose image is already in the encoder
   cache over one whose image is new. The two requests put different text
   before the image, so the KV prefix cache covers only the shared system
   prompt in both: the gap is the encoder cache alone;
2. a multi-turn image chat (an image in turn 1, another in turn 3, follow-up
   questions in between): the prefix-cache hit ratio, and each turn's time
   with every cache on over every cache off (no prefix caching, encoder
   cache off). Outputs must match between the two runs.

Cold and warm requests, and cache-on and cache-off turns, are interleaved,
and each figure is the median of ``--repeat`` runs, so a burst of load from
other processes on a shared machine does not decide a ratio.

Run: ``python benchmarks/bench_mm.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from PIL import Image

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.stage_engine import LLMEngine
from omnistage.models.loader import load_model
from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_vl
from omnistage.sampling_params import SamplingParams

MAX_IMAGE_TOKENS = 1024  # merged 28x28 squares per image
KV_BLOCKS = 2048  # 32k tokens: plenty, and no 128 MiB default pool to first-touch


def write_checkpoint(
    path: str, seed: int = 0, width: int = 64, mlp: int = 128, max_image_tokens: int = MAX_IMAGE_TOKENS
) -> str:
    """The test checkpoint with a 4-block vision tower (``width`` wide, ``mlp``
    in its MLP) and an image processor that keeps up to ``max_image_tokens``
    merged tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    write_tiny_qwen2_5_vl(path, seed)
    config = Qwen2_5_VLConfig.from_pretrained(path)
    vision = config.vision_config
    vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads = 4, width, mlp, 4
    vision.fullatt_block_indexes = [1, 3]
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval().save_pretrained(path)
    # transformers 5's layout: the image processor's settings nest in processor_config.json.
    pre = os.path.join(path, "processor_config.json")
    with open(pre) as f:
        processor = json.load(f)
    image = processor["image_processor"]
    image["max_pixels"] = image["size"]["longest_edge"] = max_image_tokens * 28 * 28
    with open(pre, "w") as f:
        json.dump(processor, f, indent=2)
    return path


def make_image(seed: int, size: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def user(text: str, image: Image.Image | None = None, before: bool = False) -> dict:
    parts = [{"type": "text", "text": text}]
    if image is not None:
        img = {"type": "image", "image": image}
        parts = parts + [img] if before else [img] + parts
    return {"role": "user", "content": parts}


def ttft(engine: LLMEngine, rid: str, messages: list[dict], params: SamplingParams) -> tuple[float, int]:
    """Seconds from add_request to the first token; finishes the request."""
    t0 = time.perf_counter()
    engine.add_request(rid, engine.encode_chat(messages), params)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
    return first, engine.runner.num_encoded_items


def bench_ttft(loaded, repeat: int, size: int) -> float:
    args = EngineArgs(model=loaded.model_path, num_kv_blocks=KV_BLOCKS, encoder_cache_size=4 * MAX_IMAGE_TOKENS)
    engine = LLMEngine(args, loaded_model=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    ttft(engine, "warmup", [user("hello", make_image(999, size))], params)
    cold, warm = [], []
    for i in range(repeat):
        image = make_image(i, size)
        t_cold, n_cold = ttft(engine, f"cold{i}", [user(f"question {i}: what is in the picture?", image)], params)
        t_warm, n_warm = ttft(engine, f"warm{i}", [user(f"and {i} again, what is here?", image, before=True)], params)
        assert n_warm == n_cold, "the second request's image must come from the encoder cache"
        cold.append(t_cold)
        warm.append(t_warm)
    c, w = statistics.median(cold), statistics.median(warm)
    num_tokens = len(engine.process_inputs("x", engine.encode_chat([user("q", make_image(0, size))])).prompt_token_ids)
    print(f"[1] TTFT, {size}x{size} image ({num_tokens} prompt tokens), median of {repeat}:")
    print(f"    image not cached {c * 1e3:8.1f} ms   image in encoder cache {w * 1e3:8.1f} ms")
    print(f"    ratio cached / not cached = {w / c:.3f}  (speed-up {c / w:.1f}x)")
    return w / c


def run_turn(engine: LLMEngine, history: list[dict], params: SamplingParams, rid: str) -> tuple[float, object]:
    """Seconds to answer the conversation so far (resent whole, as a chat client does)."""
    t0 = time.perf_counter()
    engine.add_request(rid, engine.encode_chat(history), params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
    return time.perf_counter() - t0, out


def bench_chat(loaded, repeat: int, size: int) -> tuple[float, list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    on_times: list[list[float]] = []
    off_times: list[list[float]] = []
    on = LLMEngine(EngineArgs(model=loaded.model_path, num_kv_blocks=KV_BLOCKS), loaded_model=loaded)
    off = LLMEngine(
        EngineArgs(
            model=loaded.model_path, num_kv_blocks=KV_BLOCKS, enable_prefix_caching=False, enable_encoder_cache=False
        ),
        loaded_model=loaded,
    )
    for engine in (on, off):  # warm-up: first-touch of the KV pool, lazy initialisation
        run_turn(engine, [user("warm up", make_image(1, size))], params, "warmup")
    base = on.get_stats()
    for r in range(repeat):
        turns = [
            user(f"Conversation {r}. Describe this picture.", make_image(100 + r, size)),
            user("What colour dominates?"),
            user("Compare it with this one.", make_image(200 + r, size)),
            user("Which of the two is brighter?"),
            user("Summarize our conversation."),
        ]
        history: list[dict] = []
        t_on, t_off = [], []
        for t, message in enumerate(turns):
            history.append(message)
            # alternate which side goes first, so neither always runs on a warmer machine
            order = [(on, t_on), (off, t_off)] if (r + t) % 2 == 0 else [(off, t_off), (on, t_on)]
            answers = []
            for engine, times in order:
                seconds, out = run_turn(engine, history, params, f"{r}-{t}")
                times.append(seconds)
                answers.append(out.outputs[0])
            assert answers[0].token_ids == answers[1].token_ids, "caches changed an answer"
            history.append({"role": "assistant", "content": answers[0].text})
        on_times.append(t_on)
        off_times.append(t_off)
    stats = on.get_stats()
    hits = stats.prefix_cache_hit_tokens - base.prefix_cache_hit_tokens
    hit_ratio = hits / (stats.prefix_cache_query_tokens - base.prefix_cache_query_tokens)
    per_turn_on = [statistics.median(t[i] for t in on_times) for i in range(len(turns))]
    per_turn_off = [statistics.median(t[i] for t in off_times) for i in range(len(turns))]
    ratios = [a / b for a, b in zip(per_turn_on, per_turn_off)]
    print(f"[2] 5-turn image chat (images in turns 1 and 3, 16 new tokens a turn), median of {repeat}:")
    print(f"    prefix-cache hit ratio (hit / prompt tokens, all turns) = {hit_ratio:.3f}")
    for i, (a, b, q) in enumerate(zip(per_turn_on, per_turn_off, ratios)):
        print(f"    turn {i + 1}: caches on {a * 1e3:8.1f} ms   off {b * 1e3:8.1f} ms   on / off = {q:.3f}")
    total = sum(per_turn_on) / sum(per_turn_off)
    print(f"    whole chat: on / off = {total:.3f}")
    return hit_ratio, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller images, fewer repeats")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared CPUs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeat = args.repeat or (3 if args.quick else 5)
    size = 448 if args.quick else 896
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(write_checkpoint(os.path.join(tmp, "vl")))
        ttft_ratio = bench_ttft(loaded, repeat, size)
        hit_ratio, turn_ratios = bench_chat(loaded, repeat, size)
    print(
        f"summary: ttft_cached_over_uncached={ttft_ratio:.3f} prefix_hit_ratio={hit_ratio:.3f} "
        f"turn_time_on_over_off=[{', '.join(f'{r:.3f}' for r in turn_ratios)}]"
    )


if __name__ == "__main__":
    main()
