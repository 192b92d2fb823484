"""A seeded, randomized soak: hundreds of requests through tiny text, Qwen2.5-VL
and Qwen2.5-Omni engines under pressure, each answer equal to a calm run.

The *stressed* engine has the prefix cache (and for VL the encoder cache) on,
a KV pool small enough to preempt, and a step budget small enough that
prompts are prefilled in chunks. Requests arrive in bursts and lulls, share
prompt prefixes, images (VL: more than the encoder cache holds, so it
evicts), mix greedy and seeded sampling with penalties, stop rules and n=2,
and, for Omni, text-only and spoken answers (greedy talker), image and audio
prompts, with a vocoder that runs in about half the steps. About a third
are aborted at a planned state: waiting, mid-prefill, decoding, preempted,
and for the Omni pipeline also waiting, prefilling, decoding or preempted in
the talker and queued for the vocoder. Some request ids are reused the
moment the request that held them was aborted or finished.

Every request that was not aborted is then run again in a *calm* engine (no
prefix or encoder cache, a pool too big to preempt, no chunking) and must
give the same token ids, finish and stop reasons and text, and for Omni the
same codec ids and the same waveform bit for bit. Afterwards the stressed
engine holds nothing: no queued request, KV block, batch row, payload,
staged tensor or encoder reference. Coverage is asserted too, so the soak
cannot go quiet: an abort landed in every state, preemptions, prefix and
encoder cache hits happened, and reused ids were scheduled in the very step
that dropped their last holder's rows.

The default setting (600 requests, seed 0) takes 30 to 60 seconds on two
busy cores. A longer one for manual runs::

    OMNISTAGE_SOAK_REQUESTS=5000 OMNISTAGE_SOAK_SEED=7 pytest tests/engine/test_soak.py

``OMNISTAGE_SOAK_REQUESTS`` is the total over the three models (split in the
default's proportions), ``OMNISTAGE_SOAK_SEED`` the workload's seed (default
0), ``OMNISTAGE_SOAK_VERBOSE=1`` (with ``-s``) prints what each soak covered.
A failure names the model, the engine, the request (its id, job, sampling
parameters and abort plan) and the seed, so that setting reproduces it.
"""

from __future__ import annotations

import os
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from utils_mm import clip, image, video, write_sensitive_checkpoint

from omnistage import LLM
from omnistage.core.request import Request, RequestStatus
from omnistage.core.scheduler import Scheduler
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.factory import build_engine
from omnistage.engine.omni.pipeline import OmniPipeline
from omnistage.engine.stage_engine import StageEngine
from omnistage.models.loader import load_model
from omnistage.models.qwen2_5_omni import load_qwen2_5_omni
from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint
from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni

DEFAULT_COUNTS = {"text": 300, "vl": 160, "omni": 140}


def _settings() -> tuple[int, dict[str, int]]:
    seed = int(os.environ.get("OMNISTAGE_SOAK_SEED", "0"))
    total = os.environ.get("OMNISTAGE_SOAK_REQUESTS")
    if total is None:
        return seed, dict(DEFAULT_COUNTS)
    scale = int(total) / sum(DEFAULT_COUNTS.values())
    return seed, {k: max(8, round(v * scale)) for k, v in DEFAULT_COUNTS.items()}


SEED, COUNTS = _settings()

# Block size 4 makes short prompts span several full blocks, so prefix hits are real.
COMMON = {"block_size": 4, "max_model_len": 256, "max_num_seqs": 8}
STRESSED = {"text": dict(COMMON, num_kv_blocks=28, max_num_batched_tokens=12),
            "vl": dict(COMMON, num_kv_blocks=56, max_num_batched_tokens=16),
            "omni": dict(COMMON, num_kv_blocks=40, max_num_batched_tokens=16, talker_num_kv_blocks=36)}  # fmt: skip
CALM = dict(COMMON, num_kv_blocks=1024, max_num_batched_tokens=2048, max_num_seqs=64,
            enable_prefix_caching=False, enable_encoder_cache=False)  # fmt: skip
OMNI_OPTIONS = {"talker_params": {"temperature": 0.0, "max_tokens": 6}, "talker_max_model_len": 320,
                "token2wav_requests_per_step": 1}  # fmt: skip

THINKER_STATES = ("waiting", "prefill", "decode", "preempted")
ABORT_STATES = {
    "text": THINKER_STATES,
    "vl": THINKER_STATES,
    "omni": tuple(f"{stage}-{s}" for stage in ("thinker", "talker") for s in THINKER_STATES) + ("token2wav-waiting",),
}
# States some abort must land in, planned or by an opportunist (a plan may miss its state).
REQUIRED_STATES = {
    "text": set(THINKER_STATES),
    "vl": set(THINKER_STATES),
    "omni": {f"thinker-{s}" for s in THINKER_STATES}
    | {"talker-prefill", "talker-decode", "talker-preempted", "token2wav-waiting"},
}


@dataclass
class Job:
    """One request instance of the workload."""

    key: str  # unique over the workload; the calm run's request id
    rid: str  # the id given to the stressed engine (shared by reused ids)
    prompt: Any
    params: SamplingParams
    kwargs: dict[str, Any] = field(default_factory=dict)  # the pipeline's audio options
    abort_at: tuple[str, int] | None = None  # abort at the n-th observation of this state
    # Else abort at the first sight of a required state that no abort has landed in yet.
    opportunist: bool = False
    arrival: int = 0  # the step before which it is added (unless it reuses an id)
    reuses: str | None = None  # the key of the job whose id it takes as soon as that one ended

    def describe(self) -> str:
        return (f"request {self.rid!r} (job {self.key}, {self.params}, abort_at={self.abort_at}, "
                f"reuses={self.reuses}, {self.kwargs})")  # fmt: skip


# -- workloads ---------------------------------------------------------------------


def _sampling(rng: random.Random, max_tokens: int, allow_n: bool = False) -> SamplingParams:
    """Greedy or seeded, sometimes with penalties, stop rules, min_tokens or n=2."""
    extra: dict[str, Any] = {}
    if rng.random() < 0.2:
        extra.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    if rng.random() < 0.1:
        extra["stop"] = [rng.choice(["e", "a", " t", "o"])]
    if rng.random() < 0.1:
        extra["stop_token_ids"] = [rng.randrange(3, 256) for _ in range(8)]
    if rng.random() < 0.1:
        extra["min_tokens"] = 2
    if allow_n and rng.random() < 0.08:
        extra["n"] = 2
    n = rng.randint(2, max_tokens)
    ignore_eos = rng.random() < 0.7
    if rng.random() < 0.5:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos, **extra)
    return SamplingParams(
        temperature=rng.choice([0.7, 1.0, 1.3]),
        top_k=rng.choice([-1, 5, 40]),
        top_p=rng.choice([1.0, 0.9]),
        min_p=rng.choice([0.0, 0.05]),
        seed=rng.randrange(2**31),
        max_tokens=n,
        ignore_eos=ignore_eos,
        **extra,
    )


# Steps between arrivals, scaled to what a model's stressed engine serves per step.
PACE = {"text": 1, "vl": 3, "omni": 3}


def _schedule(rng: random.Random, jobs: list[Job], kind: str) -> list[Job]:
    """Arrival steps, abort plans and id reuse over a list of jobs."""
    step, burst = 0, True
    for i, job in enumerate(jobs):
        # Bursts build a queue (waiting requests, preemptions); lulls drain it, so that
        # an id reused right after its request ended is scheduled in the very next step.
        if rng.random() < 0.1:
            burst = not burst
        step += PACE[kind] * (rng.choice([0, 0, 0, 1, 1, 2]) if burst else rng.choice([2, 4, 6, 10]))
        job.arrival = step
        if rng.random() < 0.35:
            state = rng.choice(ABORT_STATES[kind])
            # A preempted request is usually resumed at the next step: abort at the first sight.
            job.abort_at = (state, 1 if state.endswith(("preempted", "token2wav-waiting")) else rng.randint(1, 3))
        else:
            job.opportunist = rng.random() < 0.6
        if i >= 4 and rng.random() < 0.2:
            # Half the time the id of a request planned to be aborted, as fewer are.
            planned = [j for j in jobs[:i] if j.abort_at is not None]
            earlier = rng.choice(planned if planned and rng.random() < 0.5 else jobs[:i])
            job.rid, job.reuses = earlier.rid, earlier.key
    return jobs


def text_workload(rng: random.Random, n: int, vocab: int) -> list[Job]:
    """Token-id prompts: a few shared prefixes (some exactly a prompt, some a
    whole number of blocks) with random tails, and some exact repeats."""
    prefixes = [[rng.randrange(3, vocab) for _ in range(k)] for k in (8, 13, 20, 33)]
    jobs: list[Job] = []
    for i in range(n):
        if jobs and rng.random() < 0.1:
            prompt = list(rng.choice(jobs).prompt)
        else:
            head = rng.choice(prefixes + [[]])
            prompt = head + [rng.randrange(3, vocab) for _ in range(rng.randint(0 if head else 1, 14))]
        jobs.append(Job(f"t{i}", f"t{i}", prompt, _sampling(rng, 14, allow_n=True)))
    return _schedule(rng, jobs, "text")


# 4 to 64 merged tokens each, 396 in all: more than the encoder cache holds (256 rows, the largest video)
IMAGE_SIZES = [(56, 56), (60, 90), (84, 112), (112, 112), (168, 168), (112, 140),
               (224, 196), (224, 224), (196, 224), (168, 224), (140, 168), (224, 168)]  # fmt: skip
IMAGE_WEIGHTS = [8, 4, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
QUESTIONS = ["what is this?", "describe the picture in a few words.", "is there a dog?", "count the colours"]


def vl_workload(rng: random.Random, n: int, proc: MultiModalProcessor) -> list[Job]:
    """Chat prompts (the system prompt is a shared prefix) with zero to two images
    from a pool of twelve, some far more often than others, so that encoder
    outputs and image blocks are shared and the encoder cache also evicts;
    a tenth also carry one of two short videos."""
    images = [image(100 + i, h, w) for i, (h, w) in enumerate(IMAGE_SIZES)]
    videos = [video(150, 2), video(151, 4)]  # 6 and 12 merged tokens
    jobs = []
    for i in range(n):
        parts: list[dict[str, Any]] = []
        k = rng.choice([0, 1, 1, 1, 2])
        chosen = list(dict.fromkeys(rng.choices(range(len(images)), IMAGE_WEIGHTS, k=k)))
        for j in chosen:
            parts.append({"type": "image"})
        text = rng.choice(QUESTIONS) + (f" number {rng.randint(0, 9)}" if rng.random() < 0.5 else "")
        parts.insert(rng.randint(0, len(parts)), {"type": "text", "text": text})
        media: dict[str, Any] = {"image": [images[j] for j in chosen]} if chosen else {}
        if rng.random() < 0.1:
            parts.insert(rng.randint(0, len(parts)), {"type": "video"})
            media["video"] = rng.choice(videos)
        prompt: dict[str, Any] = {"prompt": proc.apply_chat_template([{"role": "user", "content": parts}])}
        if media:
            prompt["multi_modal_data"] = media
        jobs.append(Job(f"v{i}", f"v{i}", prompt, _sampling(rng, 10)))
    return _schedule(rng, jobs, "vl")


OMNI_OPENINGS = ["you are a helpful voice assistant. ", "answer briefly and kindly, in a warm voice. ", ""]
OMNI_QUESTIONS = ["hello there, how are you", "tell me a story about a fox and a dog", "one two three four five",
                  "what is the capital of france?"]  # fmt: skip
OMNI_IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"
OMNI_AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"


def omni_workload(rng: random.Random, n: int) -> list[Job]:
    """Text prompts with shared openings, some with one of two images and some
    with one of two audio clips; 60% spoken, some with their own talker length."""
    images = [image(200, 56, 56), image(201, 60, 90)]
    clips = [clip(300, 0.4), clip(301, 0.7)]
    jobs = []
    for i in range(n):
        text = rng.choice(OMNI_OPENINGS) + rng.choice(OMNI_QUESTIONS)
        if rng.random() < 0.5:
            text += f" please, {rng.randint(0, 99)} times"
        media: dict[str, Any] = {}
        if rng.random() < 0.25:
            media["image"] = rng.choice(images)
            text = OMNI_IMAGE + text
        if rng.random() < 0.15:
            media["audio"] = rng.choice(clips)
            text = OMNI_AUDIO + text
        prompt: Any = {"prompt": text, "multi_modal_data": media} if media else text
        kwargs: dict[str, Any] = {"return_audio": rng.random() < 0.6}
        if kwargs["return_audio"] and rng.random() < 0.3:
            kwargs["talker_params"] = {"temperature": 0.0, "max_tokens": rng.randint(3, 8)}
        jobs.append(Job(f"o{i}", f"o{i}", prompt, _sampling(rng, 8), kwargs))
    return _schedule(rng, jobs, "omni")


# -- where a request is --------------------------------------------------------------


def _autoregressive_state(request: Request) -> str:
    if request.status is RequestStatus.PREEMPTED:
        return "preempted"
    if request.status is RequestStatus.WAITING:
        return "waiting"
    if request.num_output_tokens == 0:
        # 0 < computed < prompt: the next chunk is still to come (a prefix hit counts as computed)
        return "prefill"
    # Decoding: everything but the last sampled token is computed. Less: a resumed request mid-recompute.
    return "decode" if request.num_computed_tokens == request.num_tokens - 1 else "resumed"


def state_of(engine: StageEngine | OmniPipeline, rid: str) -> str | None:
    """Where a live request is between steps, as an abort plan names it."""
    if isinstance(engine, StageEngine):
        # A request of n > 1 is as far as its first child.
        request = engine.scheduler.requests.get(rid) or engine.scheduler.requests.get(f"{rid}#0")
        return None if request is None else _autoregressive_state(request)
    for name in ("thinker", "talker"):
        request = engine.stages[name].scheduler.requests.get(rid)
        if request is not None:
            return f"{name}-{_autoregressive_state(request)}"
    if rid in engine.stages["token2wav"].scheduler.streams:  # between steps a vocoder request waits
        return "token2wav-waiting"
    return None


def _num_preemptions(engine: StageEngine | OmniPipeline) -> int:
    stages = engine.stages.values() if isinstance(engine, OmniPipeline) else [engine]
    return sum(s.scheduler.num_preemptions for s in stages if isinstance(s.scheduler, Scheduler))


# -- driving ---------------------------------------------------------------------------


def _add(engine: StageEngine | OmniPipeline, rid: str, job: Job) -> None:
    engine.add_request(rid, job.prompt, job.params, **job.kwargs)


def _stressed_run(
    engine: StageEngine | OmniPipeline, jobs: list[Job], kind: str, where: str
) -> tuple[dict, dict, Counter]:
    """Drive the stressed engine with arrivals, planned aborts and id reuse.

    Returns (the finished outputs by job key, the aborted keys with the state
    each was aborted in, counts of what happened: each state observed, and ids
    reused by a request scheduled in the very step that drops the rows of the
    request that ended)."""
    arrivals = deque(j for j in jobs if j.reuses is None)
    followers: dict[str, deque[Job]] = {}
    for job in jobs:
        if job.reuses is not None:
            followers.setdefault(job.rid, deque()).append(job)
    live: dict[str, Job] = {}  # rid -> the job that holds it now
    seen: dict[str, Counter] = {}  # job key -> observations of each state
    done: dict[str, RequestOutput] = {}
    aborted: dict[str, str] = {}
    events: Counter = Counter()
    reused: dict[str, tuple[str, int]] = {}  # rid just taken over -> (how its last holder ended, the step to check)
    step = 0

    def start(job: Job) -> None:
        assert job.rid not in live, f"{where}: {job.describe()} reuses an id still live"
        _add(engine, job.rid, job)
        live[job.rid] = job
        seen[job.key] = Counter()

    def ended(rid: str, how: str, next_step: int) -> None:
        """The id is free again: the next job that reuses it comes in right now."""
        del live[rid]
        queue = followers.get(rid)
        if queue:
            start(queue.popleft())
            reused[rid] = (how, next_step)

    while arrivals or live:
        while arrivals and arrivals[0].arrival <= step:
            start(arrivals.popleft())
        for rid, job in list(live.items()):
            state = state_of(engine, rid)
            if state is None:
                continue
            events[state] += 1
            seen[job.key][state] += 1
            planned = job.abort_at is not None and job.abort_at == (state, seen[job.key][state])
            uncovered = state in REQUIRED_STATES[kind] and state not in aborted.values()
            if planned or (job.opportunist and uncovered):
                engine.abort_request(rid)
                aborted[job.key] = state
                ended(rid, "abort", step)
        for out in engine.step():
            job = live.get(out.request_id)
            assert job is not None, f"{where}: an output for {out.request_id!r}, which is not live (seed {SEED})"
            assert out.error is None, f"{where}: {job.describe()} failed: {out.error} (seed {SEED})"
            if out.finished:
                done[job.key] = out
                ended(out.request_id, "finish", step + 1)
        for rid, (how, check_step) in list(reused.items()):
            if check_step == step:
                del reused[rid]
                if state_of(engine, rid) not in (None, "waiting", "thinker-waiting"):
                    events[f"id reused after {how}, scheduled at once"] += 1
        step += 1
        assert step < 100_000, f"{where}: the engine did not drain (seed {SEED})"
    assert not any(followers.values()), f"{where}: jobs reusing an id never started"
    return done, aborted, events


def _calm_run(engine: StageEngine | OmniPipeline, jobs: list[Job]) -> dict[str, RequestOutput]:
    for job in jobs:
        _add(engine, job.key, job)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, f"calm run: job {out.request_id} failed: {out.error} (seed {SEED})"
            if out.finished:
                done[out.request_id] = out
    return done


def _drain(engine: StageEngine | OmniPipeline) -> None:
    """Step while the engine owes steps (rows of ended requests still in a batch)."""
    for _ in range(10):
        if not engine.has_unfinished_requests():
            return
        assert not engine.step()
    raise AssertionError(f"the stressed engine still reports unfinished requests (seed {SEED})")


def assert_nothing_held(engine: StageEngine | OmniPipeline, where: str) -> None:
    _drain(engine)
    if isinstance(engine, OmniPipeline):
        held, stages = engine.held(), dict(engine.stages)
    else:
        held, stages = {"stage": engine.held()}, {"stage": engine}
    left = {name: h for name, h in held.items() if not h.is_empty}
    assert not left, f"{where}: still held after the soak (seed {SEED}): {left}"
    for name, stage in stages.items():
        scheduler = stage.scheduler
        if not isinstance(scheduler, Scheduler):
            continue
        kv = scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks, (
            f"{where}: stage {name}: {kv.num_free_blocks} of {kv.num_blocks} KV blocks free (seed {SEED})"
        )
        assert not kv.req_to_blocks, f"{where}: stage {name}: block tables left {list(kv.req_to_blocks)}"
        # Not in StageHeld: the random streams of preempted seeded requests, kept for their resumption.
        parked = stage.runner._parked_generators
        assert not parked, f"{where}: stage {name}: random streams parked for {list(parked)} (seed {SEED})"
        encoder = scheduler.encoder_cache_manager
        if encoder is not None:
            assert encoder.num_referenced_entries == 0 and not encoder._holders, (
                f"{where}: stage {name}: encoder entries still referenced by {list(encoder._holders)} (seed {SEED})"
            )


def assert_same_output(got: RequestOutput, want: RequestOutput, job: Job, where: str) -> None:
    def fail(what: str, a: Any, b: Any) -> str:
        return (f"{where}: {job.describe()}: {what} differ from the calm engine's (seed {SEED}):\n"
                f"  stressed: {a}\n  calm:     {b}")  # fmt: skip

    assert len(got.outputs) == len(want.outputs) == job.params.n, fail("completion counts", got.outputs, want.outputs)
    for g, w in zip(got.outputs, want.outputs):
        assert g.token_ids == w.token_ids, fail(f"completion {g.index}'s token ids", g.token_ids, w.token_ids)
        assert g.finish_reason == w.finish_reason, fail("finish reasons", g.finish_reason, w.finish_reason)
        assert g.stop_reason == w.stop_reason, fail("stop reasons", g.stop_reason, w.stop_reason)
        assert g.text == w.text, fail("texts", g.text, w.text)
    if "return_audio" not in job.kwargs:
        return
    gc, wc = got.extra.get("codec_token_ids"), want.extra.get("codec_token_ids")
    assert gc == wc, fail("codec ids", gc, wc)
    if got.audio is None or want.audio is None:
        assert got.audio is None and want.audio is None, fail("audio presence", got.audio, want.audio)
        return
    assert got.audio.dtype == np.float32 and np.array_equal(got.audio, want.audio), fail(
        "waveforms", got.audio[:8], want.audio[:8]
    )


def _count_encoder_runs(engine: StageEngine) -> Counter:
    """Wrap the runner so that the items it is told to encode are counted."""
    counts: Counter = Counter()
    execute = engine.runner.execute_model

    def counting(so: Any) -> Any:
        counts["items"] += sum(len(v) for v in so.scheduled_encoder_inputs.values())
        return execute(so)

    engine.runner.execute_model = counting  # type: ignore[method-assign]
    return counts


def soak(kind: str, make_engine: Callable[[bool], StageEngine | OmniPipeline], jobs: list[Job]) -> None:
    """Run ``jobs`` through a stressed engine (``make_engine(True)``), then the
    ones not aborted through a calm one (``make_engine(False)``), and compare."""
    where = f"{kind} soak, stressed engine"
    stressed = make_engine(True)
    thinker = stressed.thinker if isinstance(stressed, OmniPipeline) else stressed
    encoded = _count_encoder_runs(thinker)
    done, aborted_in, events = _stressed_run(stressed, jobs, kind, where)
    aborted = set(aborted_in)
    assert_nothing_held(stressed, where)

    by_key = {j.key: j for j in jobs}
    assert set(done) | aborted == set(by_key), f"{where}: jobs never ended: {set(by_key) - set(done) - aborted}"
    assert not set(done) & aborted, f"{where}: aborted jobs finished: {sorted(set(done) & aborted)}"
    calm_jobs = [j for j in jobs if j.key not in aborted]
    calm = _calm_run(make_engine(False), calm_jobs)
    for job in calm_jobs:
        assert_same_output(done[job.key], calm[job.key], job, f"{kind} soak (stressed vs calm engine)")

    # Coverage: the pressure the soak is for really happened.
    stats = thinker.get_stats()
    summary = (f"seed {SEED}: {len(jobs)} requests, aborted in {dict(Counter(aborted_in.values()))}, "
               f"{_num_preemptions(stressed)} preemptions, {stats.prefix_cache_hit_tokens} prefix-hit tokens, "
               f"{encoded['items']} media items encoded, {stats.num_steps} steps, seen: {dict(events)}")  # fmt: skip
    if os.environ.get("OMNISTAGE_SOAK_VERBOSE"):
        print(f"\n{kind} soak, {summary}")
    missing = REQUIRED_STATES[kind] - set(aborted_in.values())
    assert not missing, f"{where}: no abort landed in {sorted(missing)} ({summary})"
    assert _num_preemptions(stressed) > 0, f"{where}: nothing was preempted ({summary})"
    assert stats.prefix_cache_hit_tokens > 0, f"{where}: no prefix cache hit ({summary})"
    if kind == "vl":  # repeated images were encoded once and then hit, not encoded per request
        items = sum(len(j.prompt.mm_features) for j in calm_jobs)
        assert 0 < encoded["items"] < items // 2, f"{where}: {items} images in the finished requests ({summary})"
    for how in ("abort", "finish"):
        assert events[f"id reused after {how}, scheduled at once"], (
            f"{where}: no id was reused by a request scheduled right after the {how} of its last holder ({summary})"
        )
    assert len(calm_jobs) >= len(jobs) // 2, f"{where}: most requests were aborted ({summary})"


# -- the tests ---------------------------------------------------------------------------------


def test_soak_text(tmp_path_factory) -> None:
    path = write_tiny_checkpoint("llama", tmp_path_factory.mktemp("soak_text"))
    loaded = load_model(str(path))
    rng = random.Random(f"text-{SEED}")
    jobs = text_workload(rng, COUNTS["text"], loaded.model.vocab_size)

    def make(stressed: bool) -> StageEngine | OmniPipeline:
        return build_engine(EngineArgs(model=str(path), **(STRESSED["text"] if stressed else CALM)), loaded=loaded)

    soak("text", make, jobs)


def test_soak_vl(tmp_path_factory) -> None:
    path = write_sensitive_checkpoint("vl", tmp_path_factory.mktemp("soak_vl"))
    loaded = load_model(path)
    proc = MultiModalProcessor.from_pretrained(path)
    rng = random.Random(f"vl-{SEED}")
    jobs = vl_workload(rng, COUNTS["vl"], proc)
    engine = build_engine(EngineArgs(model=path, **COMMON), loaded=loaded)
    for job in jobs:  # processed once (the image processor is the slow part); both engines take the result
        job.prompt = engine.process_inputs(job.key, job.prompt)

    def make(stressed: bool) -> StageEngine:
        engine = build_engine(EngineArgs(model=path, **(STRESSED["vl"] if stressed else CALM)), loaded=loaded)
        assert isinstance(engine, StageEngine)
        return engine

    soak("vl", make, jobs)


def _slow_vocoder(pipeline: OmniPipeline, rng: random.Random) -> None:
    """Skip the vocoder stage in about half the pipeline's steps, as a vocoder
    slower than the talker would be: spoken requests then queue in token2wav,
    where the soak aborts some (its outputs are per request, so equality holds)."""
    stage = pipeline.stages["token2wav"]
    step = stage.step
    stage.step = lambda: [] if rng.random() < 0.5 else step()  # type: ignore[method-assign]


def test_soak_omni(tmp_path_factory) -> None:
    omni = load_qwen2_5_omni(write_tiny_qwen2_5_omni(tmp_path_factory.mktemp("soak_omni")))
    rng = random.Random(f"omni-{SEED}")
    jobs = omni_workload(rng, COUNTS["omni"])
    first = LLM(omni, **COMMON, **OMNI_OPTIONS).llm_engine
    for job in jobs:  # processed once; both engines take the result
        job.prompt = first.process_inputs(job.key, job.prompt)

    def make(stressed: bool) -> OmniPipeline:
        kwargs = STRESSED["omni"] if stressed else dict(CALM, talker_num_kv_blocks=1024)
        pipeline = LLM(omni, **kwargs, **OMNI_OPTIONS).llm_engine
        assert isinstance(pipeline, OmniPipeline)
        if stressed:
            _slow_vocoder(pipeline, random.Random(f"vocoder-{SEED}"))
        return pipeline

    soak("omni", make, jobs)
