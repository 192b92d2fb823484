"""The omni pipeline (thinker -> talker -> token2wav) with its caches on and off.

One process, one run, the tiny Qwen2.5-Omni checkpoint, fp32, one torch thread:

(a) **No shared prefixes.** Every request has its own prompt, so nothing ever
    hits. The thinker's tensor prefix cache on over off, with KV prefix caching
    on in both. The cache writes every step and serves nothing here, so this is
    its pure overhead. Reported end to end and for the thinker stage alone.
    Target: at most 5 % slower.
(b) **Multi-turn with shared prefixes.** Conversations whose turn ``k`` repeats
    turn ``k - 1`` (prompt and answer) and adds a question. It reports time to
    audio (arrival to waveform, mean over the turns after the first) and total
    time, all caches on (KV prefix + tensor prefix) over all off.

Times are this thread's CPU time (``time.thread_time``; torch runs on one
thread): on a shared machine, other processes' load does not count, which wall
time cannot promise. The pipeline runs on one thread and never waits, so on an
idle machine the two agree. Time to audio is the CPU time the pipeline spent
from the start of a turn to the step that produced the request's waveform.
Each configuration gets a fresh pipeline per round, so that no round hits what
an earlier one cached. Rounds alternate between the configurations, and each
measure is the best of its rounds: CPU time still varies with the memory
traffic of other processes, and the least disturbed round is the best estimate
of the cost. The tensor cache's memory is printed beside its KV pool.

(c) **Time to first audio, streamed vs not.** One spoken request whose talker
    makes ``STREAM_CODES`` codes (its stop codes suppressed, so every round
    speaks as long): ``generate_stream`` (token2wav on chunks while the talker
    speaks) against ``generate`` (one whole decode once the talker is done).
    CPU seconds from the call to the step that produced the first audio, and
    to the last; median and range of the interleaved rounds, with the load
    average. The tiny DiT's blocks are 4 mel frames (the published 24), so its
    chunks are 6 codes instead of 36.

(d) **How the streamed audio differs from a whole decode** (Qwen2.5-Omni's
    DiT is not causal): random codes of several lengths and seeds through
    the authors' chunk schedule and through one whole decode; the max abs
    difference and the SNR (whole decode as signal), on the tiny DiT's blocks
    (4 frames) and with its blocks widened to the published 24 frames (the
    same weights: the block size only masks attention).

Run: ``python benchmarks/bench_omni.py`` (``--quick`` for a smaller run;
``--only streaming`` for (c) and (d) alone).
``--side-by-side`` instead runs both tiny checkpoints, Qwen2.5-Omni and
Qwen3-Omni, on the same chat prompts: real-time factor per stage, and the
caches on / off on no-hit and multi-turn work (``side_by_side``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omnistage.models.qwen2_5_omni import OmniModel, load_qwen2_5_omni
from omnistage import LLM
from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni
from omnistage.sampling_params import SamplingParams

BLOCK = 16
TALKER = {"temperature": 0.0, "max_tokens": 4}  # few codes: token2wav would otherwise be all there is
TEXT_TOKENS_A = 48  # many decode steps: the cache's per-step cost weighs most there


def build(omni: OmniModel, caches: str, **kw: Any) -> LLM:
    """``caches``: "all" (KV prefix + tensor prefix), "kv" (KV prefix only; a hit
    would raise, so only for workloads without one) or "none"."""
    return LLM(
        omni,
        block_size=BLOCK,
        max_model_len=4096,
        num_kv_blocks=kw.pop("num_kv_blocks", 2048),
        max_num_seqs=16,
        talker_max_model_len=4200,
        talker_params=kw.pop("talker_params", dict(TALKER)),
        enable_prefix_caching=caches != "none",
        enable_tensor_prefix_cache=caches == "all",
        **kw,
    )


class CpuClock:
    """CPU seconds spent in a pipeline's steps (and in its thinker stage's), and the
    clock reading at which each output completed (``out.extra["cpu_done"]``)."""

    def __init__(self, llm: LLM) -> None:
        self.now = 0.0
        self.thinker = 0.0
        pipeline, stage = llm.llm_engine, llm.llm_engine.stages["thinker"]
        step, thinker_step = pipeline.step, stage.step

        def pipeline_step() -> Any:
            t0 = time.thread_time()
            outs = step()
            self.now += time.thread_time() - t0
            for out in outs:
                out.extra["cpu_done"] = self.now
            return outs

        def stage_step() -> Any:
            t0 = time.thread_time()
            try:
                return thinker_step()
            finally:
                self.thinker += time.thread_time() - t0

        pipeline.step = pipeline_step  # type: ignore[method-assign]
        stage.step = stage_step  # type: ignore[method-assign]


def no_shared_prefixes(omni: OmniModel, caches: str, num: int, prompt_len: int, seed: int) -> dict[str, float]:
    llm = build(omni, caches)
    clock = CpuClock(llm)
    rng = np.random.default_rng(seed)
    # Random byte tokens (ids < 256): no two prompts share even their first block.
    prompts = [rng.integers(0, 256, prompt_len).tolist() for _ in range(num)]
    params = SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS_A, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert all(o.num_cached_tokens == 0 for o in outs) and len(outs) == num
    return {"total": clock.now, "thinker": clock.thinker, "wall": wall}


def multi_turn(omni: OmniModel, caches: str, convs: int, turns: int, system_len: int, seed: int) -> dict[str, float]:
    llm = build(omni, caches)
    clock = CpuClock(llm)
    tok = llm.get_tokenizer()
    rng = np.random.default_rng(seed)
    histories = [rng.integers(0, 256, system_len).tolist() for _ in range(convs)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    later_ttfa: list[float] = []
    first_audio: list[float] = []
    hits = 0
    t0 = time.perf_counter()
    for turn in range(turns):
        start = clock.now
        outs = llm.generate(histories, params, use_tqdm=False)
        if turn:
            later_ttfa += [o.extra["cpu_done"] - start for o in outs]
            first_audio.append(min(o.extra["cpu_done"] for o in outs) - start)
            hits += sum(o.num_cached_tokens > 0 for o in outs)
        question = tok(f" user: and what happened in part {turn + 2}?").input_ids
        histories = [h + list(o.outputs[0].token_ids) + question for h, o in zip(histories, outs)]
    wall = time.perf_counter() - t0
    if caches == "all":
        assert hits == convs * (turns - 1), f"expected every later turn to hit, got {hits}"
    return {
        "total": clock.now, "thinker": clock.thinker, "wall": wall,
        "ttfa": statistics.mean(later_ttfa), "first_audio": statistics.mean(first_audio),
    }  # fmt: skip


STREAM_CODES = 48  # codec frames per spoken answer in (c): 0.96 s of audio


def first_audio(omni: OmniModel, stream: bool, seed: int) -> dict[str, float]:
    """CPU seconds to the first and to the last audio of one spoken request."""
    talker = omni.talker_module.config
    stops = [talker.tts_codec_pad_token_id, talker.tts_codec_start_token_id, talker.tts_codec_end_token_id]
    llm = build(omni, "all", talker_params={"temperature": 0.0, "max_tokens": STREAM_CODES, "suppress_token_ids": stops})
    clock = CpuClock(llm)
    prompt = np.random.default_rng(seed).integers(0, 256, 64).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    if stream:
        first = last = None
        for event in llm.generate_stream(prompt, params):
            if event.new_audio_chunks and first is None:
                first = clock.now
            if event.finished:
                last, out = clock.now, event.output
    else:
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        first = last = out.extra["cpu_done"]
    assert len(out.extra["codec_token_ids"]) == STREAM_CODES and first is not None and last is not None
    return {"first": first, "last": last, "chunks": float(len(out.audio_chunks))}


def streaming_section(omni: OmniModel, rounds: int) -> None:
    """(c): time to first audio, streamed vs not, interleaved rounds."""
    first_audio(omni, True, seed=-1 % 2**32)  # warm up
    samples: dict[str, list[dict[str, float]]] = {"streamed": [], "whole": []}
    load_before = os.getloadavg()
    for r in range(rounds):
        order = ["streamed", "whole"] if r % 2 == 0 else ["whole", "streamed"]
        for name in order:
            samples[name].append(first_audio(omni, name == "streamed", seed=r))
    load_after = os.getloadavg()
    print(f"(c) time to first audio: 1 request, 64 prompt tokens, 16 text tokens, {STREAM_CODES} codes "
          f"({STREAM_CODES * 0.02:.2f} s of audio); median [min, max] of {rounds} interleaved rounds, CPU seconds; "
          f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}")  # fmt: skip
    for key, label in (("first", "to first audio"), ("last", "to last audio")):
        on, off = ([s[key] for s in samples[n]] for n in ("streamed", "whole"))
        print(f"    {label:<16}: streamed {_spread(on)}, not streamed {_spread(off)}, "
              f"streamed/not = {statistics.median(on) / statistics.median(off):.3f}")  # fmt: skip
    print(f"    audio chunks: streamed {samples['streamed'][0]['chunks']:.0f}, not streamed {samples['whole'][0]['chunks']:.0f}")


def chunked_vs_whole(omni: OmniModel, lengths: tuple[int, ...], seeds: int) -> None:
    """(d): max abs difference and SNR of the streamed decode against the whole one."""
    import copy

    from omnistage.models.chunked_vocoder import decode_in_chunks
    from omnistage.models.qwen2_5_omni_token2wav import Qwen2_5OmniToken2Wav

    base = omni.token2wav
    vocab = int(base.dit.config.num_embeds)
    print("(d) streamed (authors' chunk schedule) vs whole decode, random codes; max |diff| and SNR, "
          "worst over seeds")  # fmt: skip
    for block in (int(base.dit.config.block_size), 24):
        module = copy.deepcopy(base.token2wav)
        module.code2wav_dit_model.config.block_size = block
        module.code2wav_dit_model.block_size = block
        token2wav = Qwen2_5OmniToken2Wav(module, base.speakers)
        sched = token2wav.chunk_schedule(True)
        print(f"    DiT block {block} frames: chunks of {sched.size} codes, {sched.lookahead} codes ahead, "
              f"{token2wav.past_frames // 2} back, BigVGAN context {token2wav.vocoder_context} frames")  # fmt: skip
        for n in lengths:
            worst_abs, worst_snr, chunks = 0.0, float("inf"), 0
            for seed in range(seeds):
                codes = np.random.default_rng(seed).integers(0, vocab, n).tolist()
                stream = decode_in_chunks(token2wav, codes, "Chelsie", seed)
                whole = token2wav(codes, "Chelsie", seed=seed).astype(np.float64)
                diff = np.concatenate(stream).astype(np.float64) - whole
                assert diff.shape == whole.shape
                err = float(np.sum(diff**2))
                snr = float("inf") if err == 0 else 10 * np.log10(float(np.sum(whole**2)) / err)
                worst_abs, worst_snr, chunks = max(worst_abs, float(np.abs(diff).max())), min(worst_snr, snr), len(stream)
            print(f"      {n:4d} codes ({chunks} chunks): max |diff| {worst_abs:.2e}, SNR {worst_snr:6.1f} dB "
                  f"(|whole| max ~{np.abs(whole).max():.2f})")  # fmt: skip


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f} s [{min(values):.3f}, {max(values):.3f}]"


def interleaved(rounds: int, runs: dict[str, Callable[[int], dict[str, float]]]) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            samples[name].append(runs[name](r))
    return {name: {key: min(s[key] for s in runs_) for key in runs_[0]} for name, runs_ in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a Qwen2.5-Omni folder (default: write the tiny one)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=["streaming"], help="run one section alone")
    parser.add_argument("--side-by-side", action="store_true", help="only Qwen2.5-Omni beside Qwen3-Omni")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = 3 if args.quick else 7
    if args.side_by_side:
        side_by_side(rounds, args.quick)
        return
    scratch = tempfile.TemporaryDirectory(prefix="bench_omni_")  # removed when main returns
    path = args.checkpoint or write_tiny_qwen2_5_omni(scratch.name)
    omni = load_qwen2_5_omni(path)
    if args.only == "streaming":
        streaming_section(omni, rounds)
        chunked_vs_whole(omni, (12, 48, 150), seeds=2 if args.quick else 3)
        return

    # Warm up both paths once (first calls allocate and compile kernels).
    no_shared_prefixes(omni, "all", 2, 64, seed=-1 % 2**32)
    multi_turn(omni, "all", 1, 2, 64, seed=12345)

    num, prompt_len = (8, 256) if args.quick else (16, 512)
    a = interleaved(rounds, {
        "on": lambda r: no_shared_prefixes(omni, "all", num, prompt_len, seed=r),
        "off": lambda r: no_shared_prefixes(omni, "kv", num, prompt_len, seed=r),
    })  # fmt: skip
    convs, turns, system_len = (4, 3, 768) if args.quick else (6, 4, 1536)
    b = interleaved(rounds, {
        "on": lambda r: multi_turn(omni, "all", convs, turns, system_len, seed=100 + r),
        "off": lambda r: multi_turn(omni, "none", convs, turns, system_len, seed=100 + r),
    })  # fmt: skip

    probe = build(omni, "all")
    cache = probe.llm_engine.stages["thinker"].runner.tensor_cache
    kv_bytes = sum(t.numel() * t.element_size() for t in probe.llm_engine.stages["thinker"].runner.kv_caches)
    thinker = omni.thinker.model

    print(f"tiny Qwen2.5-Omni, fp32, {args.threads} thread(s), best of {rounds} interleaved rounds, CPU seconds")
    print(f"(a) no shared prefixes: {num} requests x {prompt_len} prompt tokens, {TEXT_TOKENS_A} text tokens, "
          f"{TALKER['max_tokens']} codes; tensor prefix cache on / off (KV prefix caching on in both)")  # fmt: skip
    report("end to end", a, "total", target=1.05)
    report("thinker stage", a, "thinker", target=1.05)
    report("wall clock, end to end", a, "wall")
    print(f"(b) multi-turn: {convs} conversations x {turns} turns, {system_len}-token first prompt, "
          "24 text tokens per turn; all caches on / off")  # fmt: skip
    report("time to audio, turns 2+ (mean per request)", b, "ttfa")
    report("time to first audio of a turn, turns 2+", b, "first_audio")
    report("total", b, "total")
    report("thinker stage", b, "thinker")
    report("wall clock, total", b, "wall")
    mib = 2**20
    print(f"tensor prefix cache: {cache.nbytes / mib:.2f} MiB = {cache.cache.num_blocks} blocks x {BLOCK} slots x "
          f"{thinker.hidden_size} {thinker.dtype} + 1 flag byte per slot; {cache.nbytes / kv_bytes:.1%} of the "
          f"thinker's KV pool ({kv_bytes / mib:.2f} MiB)")  # fmt: skip
    ratio = thinker.hidden_size / (2 * thinker.num_layers * thinker.num_kv_heads * thinker.head_dim)
    print(f"  rows / KV per slot = {thinker.hidden_size} / (2 x {thinker.num_layers} layers x "
          f"{thinker.num_kv_heads} KV heads x {thinker.head_dim}) = {ratio:.1%}; Qwen2.5-Omni-7B: 3584 / 28672 = 12.5%")
    streaming_section(omni, rounds)
    chunked_vs_whole(omni, (12, 48, 150), seeds=2 if args.quick else 3)


def report(label: str, results: dict[str, dict[str, float]], key: str, target: float | None = None) -> None:
    on, off = results["on"][key], results["off"][key]
    goal = f"  (target <= {target})" if target is not None else ""
    print(f"    {label:<44}: on {on:7.3f} s, off {off:7.3f} s, on/off = {on / off:.3f}{goal}")


# ---------------------------------------------------------------------------------------------
# Qwen3-Omni beside Qwen2.5-Omni (``--side-by-side``): both tiny checkpoints, the same chat
# prompts, one run. Kept apart from the Qwen2.5-only measures above so either can change alone.


def _chat(tok: Any, body: list[int], history: list[int] | None = None) -> list[int]:
    """``history`` (or nothing) + a user turn of ``body`` tokens + the assistant prompt: Qwen3-Omni's
    talker reads the user turns and the last assistant turn, so every prompt is a chat."""
    head = tok("<|im_start|>user\n").input_ids
    tail = tok("<|im_end|>\n<|im_start|>assistant\n").input_ids
    return (history or []) + head + body + tail


class StageClocks:
    """CPU seconds spent in each stage's ``step`` (this thread; torch runs on one)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = {name: 0.0 for name in llm.llm_engine.stages}
        for name, stage in llm.llm_engine.stages.items():
            stage.step = self._timed(name, stage.step)  # type: ignore[method-assign]

    def _timed(self, name: str, step: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            t0 = time.thread_time()
            try:
                return step()
            finally:
                self.seconds[name] += time.thread_time() - t0

        return timed


def _side_llm(omni: Any, caches: str) -> LLM:
    return LLM(
        omni, block_size=BLOCK, max_model_len=2048, num_kv_blocks=1024, max_num_seqs=8, talker_max_model_len=2200,
        talker_params={"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 12},
        enable_prefix_caching=caches != "none", enable_tensor_prefix_cache=caches == "all",
    )  # fmt: skip


def _side_no_hits(omni: Any, caches: str, num: int, prompt_len: int, seed: int) -> dict[str, float]:
    llm = _side_llm(omni, caches)
    clocks = StageClocks(llm)
    rng = np.random.default_rng(seed)
    tok = llm.get_tokenizer()
    prompts = [_chat(tok, rng.integers(0, 256, prompt_len).tolist()) for _ in range(num)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert all(o.num_cached_tokens == 0 and o.audio is not None for o in outs)
    audio_s = sum(o.audio.shape[0] for o in outs) / outs[0].sample_rate
    return {"total": sum(clocks.seconds.values()), "audio_s": audio_s,
            **{f"rtf_{k}": v / audio_s for k, v in clocks.seconds.items()}}  # fmt: skip


def _side_multi_turn(omni: Any, caches: str, convs: int, turns: int, system_len: int, seed: int) -> dict[str, float]:
    llm = _side_llm(omni, caches)
    clocks = StageClocks(llm)
    tok = llm.get_tokenizer()
    rng = np.random.default_rng(seed)
    histories = [_chat(tok, rng.integers(0, 256, system_len).tolist()) for _ in range(convs)]
    # The answers go back into the history as text: the tiny model's random answers must not
    # hold media placeholders (or chat markers), which would ask for media no turn carries.
    added = sorted(tok.added_tokens_decoder)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, suppress_token_ids=added)
    hits = 0
    for turn in range(turns):
        outs = llm.generate(histories, params, use_tqdm=False)
        hits += sum(o.num_cached_tokens > 0 for o in outs)
        question = tok(f"and what happened in part {turn + 2}?").input_ids
        histories = [_chat(tok, question, h + list(o.outputs[0].token_ids)) for h, o in zip(histories, outs)]
    if caches == "all":
        assert hits == convs * (turns - 1), f"expected every later turn to hit, got {hits}"
    return {"total": sum(clocks.seconds.values()), "thinker": clocks.seconds["thinker"]}


def _side_first_audio(omni: Any, stream: bool, seed: int) -> dict[str, float]:
    """CPU seconds from the call to the first audio (streamed: the first chunk; not
    streamed: the whole waveform, which is the first audio there), and to the end."""
    llm = LLM(
        omni, block_size=BLOCK, max_model_len=2048, num_kv_blocks=1024, max_num_seqs=8, talker_max_model_len=2200,
        talker_params={"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 24},
    )  # fmt: skip
    base = llm.llm_engine.default_talker_params
    # Every round speaks as long: the stop codes are suppressed instead of stopping.
    talker = {"stop_token_ids": (), "suppress_token_ids": (*base.suppress_token_ids, *base.stop_token_ids)}
    tok = llm.get_tokenizer()
    prompt = _chat(tok, np.random.default_rng(seed).integers(0, 256, 64).tolist())
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    t0 = time.thread_time()
    first = None
    if stream:
        for event in llm.generate_stream([prompt], params, talker_params=talker):
            if first is None and event.new_audio_chunks:
                first = time.thread_time() - t0
    else:
        llm.generate([prompt], params, use_tqdm=False, talker_params=talker)
    end = time.thread_time() - t0
    return {"first": end if first is None else first, "end": end}


def _spread(runs: list[dict[str, float]], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return min(values), statistics.median(values), max(values)


def side_by_side(rounds: int, quick: bool) -> None:
    """Qwen2.5-Omni and Qwen3-Omni (tiny, fp32): real-time factor per stage, time to
    first audio streamed / not, and the caches on / off on no-hit and multi-turn work,
    rounds interleaved across models and configurations."""
    from omnistage.models.qwen3_omni import load_qwen3_omni
    from omnistage.testing.tiny_qwen3_omni_checkpoint import write_tiny_qwen3_omni

    scratch = tempfile.TemporaryDirectory(prefix="bench_omni_")  # removed when this returns
    models = {
        "Qwen2.5-Omni": load_qwen2_5_omni(write_tiny_qwen2_5_omni(f"{scratch.name}/q25")),
        "Qwen3-Omni": load_qwen3_omni(write_tiny_qwen3_omni(f"{scratch.name}/q3")),
    }
    num, prompt_len = (4, 128) if quick else (8, 256)
    convs, turns, system_len = (2, 3, 256) if quick else (4, 3, 512)
    for omni in models.values():  # warm up: first calls allocate
        _side_no_hits(omni, "all", 1, 32, seed=12345)
    samples: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for r in range(rounds):
        for name, omni in (models.items() if r % 2 == 0 else reversed(models.items())):
            for caches in (("all", "kv") if r % 2 == 0 else ("kv", "all")):
                samples.setdefault((name, "no-hits", caches), []).append(_side_no_hits(omni, caches, num, prompt_len, r))
            for caches in (("all", "none") if r % 2 == 0 else ("none", "all")):
                run = _side_multi_turn(omni, caches, convs, turns, system_len, 100 + r)
                samples.setdefault((name, "multi-turn", caches), []).append(run)
    ttfa: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for r in range(rounds):
        for name, omni in models.items() if r % 2 == 0 else reversed(models.items()):
            for stream in (True, False) if r % 2 == 0 else (False, True):
                ttfa.setdefault((name, stream), []).append(_side_first_audio(omni, stream, 200 + r))
    print(f"\nside by side, tiny checkpoints, fp32, {torch.get_num_threads()} thread(s), {rounds} interleaved rounds; "
          f"CPU seconds as min / median / max; load: {_uptime()}")  # fmt: skip
    print(f"(c) real-time factor per stage (stage CPU s / audio s), {num} requests x {prompt_len}-token prompts, "
          "24 text tokens, up to 12 codes, every cache on")  # fmt: skip
    for name in models:
        runs = samples[(name, "no-hits", "all")]
        stages = [k for k in runs[0] if k.startswith("rtf_")]
        cells = ", ".join(f"{k[4:]} {_spread(runs, k)[0]:.3f}" for k in stages)
        print(f"    {name:<13} best RTF: {cells}  (audio {runs[0]['audio_s']:.2f} s)")
    print("(f) time to first audio, one request, 24 codes (stops suppressed): streamed / not (CPU s, min/median/max)")
    for name in models:
        st, whole = ttfa[(name, True)], ttfa[(name, False)]
        lo_s, med_s, hi_s = _spread(st, "first")
        lo_w, med_w, hi_w = _spread(whole, "first")
        print(f"    {name:<13} streamed {lo_s:.3f}/{med_s:.3f}/{hi_s:.3f}  not {lo_w:.3f}/{med_w:.3f}/{hi_w:.3f}  "
              f"ratio median {med_s / med_w:.3f}; streamed end {_spread(st, 'end')[1]:.3f}")  # fmt: skip
    print("(d) tensor prefix cache on / off, no shared prefixes (KV prefix caching on in both; target <= 1.03)")
    for name in models:
        on, off = samples[(name, "no-hits", "all")], samples[(name, "no-hits", "kv")]
        lo_on, med_on, hi_on = _spread(on, "total")
        lo_off, med_off, hi_off = _spread(off, "total")
        print(f"    {name:<13} on {lo_on:.3f}/{med_on:.3f}/{hi_on:.3f}  off {lo_off:.3f}/{med_off:.3f}/{hi_off:.3f}"
              f"  on/off best {lo_on / lo_off:.3f}, median {med_on / med_off:.3f}")  # fmt: skip
    print(f"(e) multi-turn, {convs} conversations x {turns} turns, {system_len}-token first prompt: all caches on / off")
    for name in models:
        on, off = samples[(name, "multi-turn", "all")], samples[(name, "multi-turn", "none")]
        for key in ("total", "thinker"):
            lo_on, med_on, _ = _spread(on, key)
            lo_off, med_off, _ = _spread(off, key)
            print(f"    {name:<13} {key:<8} on {lo_on:.3f} off {lo_off:.3f}  on/off best {lo_on / lo_off:.3f}, "
                  f"median {med_on / med_off:.3f}")  # fmt: skip


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "loadavg " + " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
