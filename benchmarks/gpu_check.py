"""Checks and measurements that need a CUDA device (issue 17, "The GPU path").

Run by ``benchmarks/gpu_check.sh``; each section prints ``PASS``/``FAIL`` (and
numbers) and the next one runs regardless:

1. ``engine``: the embedded default model, fp32, greedy, on ``cuda``:
   omnistage's tokens equal ``transformers``' ``generate`` on the same device,
   and the throughput of both (8 prompts x 32 tokens, best of 3).
2. ``omni``: the tiny Qwen2.5-Omni pipeline on ``cuda`` (thinker rows through
   ``HostCopier``: side stream, pinned buffers) against the same requests on
   ``cpu``: equal thinker and codec tokens; copier buffer counts; and, with
   ``torch.cuda.set_sync_debug_mode("warn")``, the synchronizing calls per
   thinker step and where they come from (expected: the sampler's token read,
   nothing from the rows' copy).
3. ``copy``: device-to-host bandwidth of a step's rows ([N, 2048] bf16):
   blocking ``.to("cpu")``, ``HostCopier`` start + wait, and a raw
   ``copy_(non_blocking=True)`` into pinned memory, in GB/s.

Usage: python benchmarks/gpu_check.py [--sections engine,omni,copy] [--device cpu]
(``--device cpu`` is a dry run of sections 1-2 here, to check the script.)
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from omnistage.sampling_params import SamplingParams

PROMPTS = [f"Write one sentence about {t}." for t in ("the sea", "a robot", "coffee", "trains", "bees", "a kite", "rain", "stars")]


def engine_section() -> None:
    from transformers import AutoModelForCausalLM

    from omnistage.engine.arg_utils import EngineArgs
    from omnistage.engine.stage_engine import LLMEngine
    from omnistage.models.loader import load_model

    loaded = load_model(None, dtype="float32", device=DEVICE)
    engine = LLMEngine(EngineArgs(dtype="float32", device=DEVICE), loaded_model=loaded)
    tok = engine.tokenizer
    num_prompts, new_tokens, reps = (8, 32, 3) if DEVICE == "cuda" else (2, 4, 1)  # cpu: a dry run
    chats = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:num_prompts]]
    ids = [c["prompt_token_ids"] for c in chats]
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(loaded.model_path, dtype=torch.float32).eval().to(DEVICE)
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": ids}, return_tensors="pt").to(DEVICE)
    ours_t, ref_t, equal = [], [], 0
    for r in range(reps):
        _sync()
        t0 = time.perf_counter()
        for i, c in enumerate(chats):
            engine.add_request(f"r{r}-{i}", c, greedy)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        _sync()
        ours_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = hf.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        _sync()
        ref_t.append(time.perf_counter() - t0)
        width = batch["input_ids"].shape[1]
        by_id = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
        equal = sum(by_id[f"r{r}-{i}"] == gen[i, width:].tolist() for i in range(len(chats)))
    total = len(chats) * new_tokens
    print(f"engine: tokens equal to transformers on {DEVICE}: {equal}/{len(chats)}")
    print(f"engine: throughput tok/s omnistage {total / min(ours_t):.0f}, transformers {total / min(ref_t):.0f}")
    print("engine:", "PASS" if equal == len(chats) else "FAIL")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def omni_section() -> None:
    from omnistage import LLM
    from omnistage.models.qwen2_5_omni import load_qwen2_5_omni
    from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni

    scratch = tempfile.TemporaryDirectory(prefix="gpu_check_")  # removed when this returns
    folder = write_tiny_qwen2_5_omni(Path(scratch.name) / "omni")
    small = {"block_size": 4, "max_model_len": 256, "num_kv_blocks": 256, "talker_max_model_len": 320}
    talker = {"temperature": 0.0, "max_tokens": 8}
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    results = {}
    for device in ("cpu", DEVICE):
        llm = LLM(load_qwen2_5_omni(folder, device=device), talker_params=dict(talker), device=device, **small)
        tok = llm.get_tokenizer()
        base = tok("system: you are a voice assistant. user: tell me about a fox.").input_ids
        first = llm.generate([base], sp, use_tqdm=False)[0]
        turn2 = base + list(first.outputs[0].token_ids) + tok(" user: and then?").input_ids
        runner = llm.llm_engine.stages["thinker"].runner
        syncs: collections.Counter[str] = collections.Counter()
        steps = 0
        if device == "cuda" and DEVICE == "cuda":
            original = runner.execute_model

            def traced(so, original=original, syncs=syncs):
                nonlocal steps
                steps += 1
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        return original(so)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                        for w in caught:
                            syncs[_origin(w)] += 1

            runner.execute_model = traced
        outs = [first, *llm.generate([turn2, tok("an unrelated prompt").input_ids], sp, use_tqdm=False)]
        results[device] = outs
        if device == DEVICE:
            copier = runner.host_copier
            print(f"omni: host copier {type(copier.device).__name__ if copier else None}, "
                  f"buffers allocated {copier.buffers.allocated if copier else '-'}, "
                  f"reused {copier.buffers.reused if copier else '-'}")
            print(f"omni: {sum(syncs.values())} synchronizing calls over {steps} thinker steps:")
            for where, count in syncs.most_common(8):
                print(f"omni:   {count:4d}  {where}")
    same = all(
        a.outputs[0].token_ids == b.outputs[0].token_ids and a.extra.get("codec_token_ids") == b.extra.get("codec_token_ids")
        for a, b in zip(results["cpu"], results[DEVICE])
    )
    print("omni: thinker and codec tokens equal cpu:", same)
    print("omni:", "PASS" if same else "FAIL")


def _origin(w: warnings.WarningMessage) -> str:
    """The omnistage frame that made a synchronizing call (from the warning's stack)."""
    stack = [f for f in traceback.extract_stack() if "omnistage" in f.filename and "gpu_check" not in f.filename]
    where = f"{Path(stack[-1].filename).name}:{stack[-1].lineno}" if stack else f"{Path(w.filename).name}:{w.lineno}"
    return f"{where} {str(w.message)[:60]}"


def copy_section() -> None:
    from omnistage.worker.host_copy import CudaCopyDevice, HostCopier

    copier = HostCopier(CudaCopyDevice(torch.device("cuda")))
    for rows in (256, 4096, 16384):
        src = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
        pinned = torch.empty_like(src, device="cpu").pin_memory()
        nbytes = src.numel() * src.element_size()

        def blocking(src=src):
            src.to("cpu")

        def host_copier(src=src):
            copier.start(src).wait()

        def raw_pinned(src=src, pinned=pinned):
            pinned.copy_(src, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        line = []
        for name, fn in (("blocking .to(cpu)", blocking), ("HostCopier", host_copier), ("raw pinned", raw_pinned)):
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            line.append(f"{name} {nbytes / statistics.median(times) / 1e9:6.1f} GB/s")
        print(f"copy: [{rows}, 2048] bf16 ({nbytes / 2**20:.0f} MiB): " + ", ".join(line))
    print(f"copy: buffers allocated {copier.buffers.allocated}, reused {copier.buffers.reused}")
    print("copy: PASS")


DEVICE = "cuda"
SECTIONS = {"engine": engine_section, "omni": omni_section, "copy": copy_section}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device visible")
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            SECTIONS[name]()
        except Exception:  # noqa: BLE001 (one section's failure must not hide the others' results)
            traceback.print_exc()
            print(f"{name}: FAIL (exception)")
        print(f"{name}: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
