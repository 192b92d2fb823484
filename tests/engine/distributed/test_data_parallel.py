"""Data-parallel replicas on a local Ray instance: greedy outputs equal the
single engine's (Qwen2.5-VL images and video, the Qwen2.5-Omni thinker's
audio; chunked prefill and prefix caching on); a request goes to the replica
caching its prefix; a killed replica fails only its own requests (and those
that had streamed nothing move); nothing stays held; /metrics says each
replica's load.

Two facades for the module (one per checkpoint), each two replicas: actor
start-up is most of the time here. The kill test runs last on the omni one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import ray
from utils_mm import chat_prompt, clip, image, video, write_sensitive_checkpoint

from omnistage import LLM
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.distributed.data_parallel import DataParallelEngine
from omnistage.entrypoints.openai.api_server import ServerOptions, ServerThread, build_app
from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Chunked prefill (16-token steps split every item's span) and prefix caching on.
ARGS: dict[str, Any] = dict(block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True, max_num_seqs=8)

CASES = {
    "vl": [
        (["image", "text"], lambda: {"image": image(0)}),
        (["text", "image", "text", "image"], lambda: {"image": [image(1), image(2, 140, 140)]}),
        (["video", "text"], lambda: {"video": video(0)}),
        (["video", "image", "text"], lambda: {"video": video(1, 4), "image": image(4)}),
        (["text"], lambda: {}),
    ],
    "omni": [
        (["audio", "text"], lambda: {"audio": clip(0, 1.3)}),
        (["image", "audio", "text"], lambda: {"image": image(1), "audio": clip(1, 2.0)}),
        (["audio", "text"], lambda: {"audio": clip(2, 0.7)}),
        (["text", "video"], lambda: {"video": video(2)}),
        (["text"], lambda: {}),
    ],
}


class Setup:
    """A checkpoint, its prompts, the single engine's answers, and the 2-replica LLM."""

    def __init__(self, kind: str, path: str) -> None:
        self.path = path
        proc = MultiModalProcessor.from_pretrained(path)
        self.prompts = [
            chat_prompt(proc, parts, data(), text=f"{kind} question {i}") if data() else f"{kind} plain text {i}"
            for i, (parts, data) in enumerate(CASES[kind])
        ]
        self.single = LLM(path, **ARGS)
        self.refs = tokens(self.single.generate(self.prompts, GREEDY, use_tqdm=False))
        self.llm = LLM(path, data_parallel_size=2, **ARGS)
        self.engine: DataParallelEngine = self.llm.llm_engine


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def drain(engine: DataParallelEngine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def assert_nothing_held(engine: DataParallelEngine) -> None:
    drain(engine)  # the steps replicas owe to drop ended rows
    held = engine.held()
    assert held and all(h.is_empty for h in held.values()), held


@pytest.fixture(scope="module")
def setups(ray_local, tmp_path_factory):
    made: dict[str, Setup] = {}

    def get(kind: str) -> Setup:
        if kind not in made:
            made[kind] = Setup(kind, write_sensitive_checkpoint(kind, tmp_path_factory.mktemp(kind)))
        return made[kind]

    yield get
    for s in made.values():
        s.engine.shutdown()


@pytest.mark.parametrize("kind", ["vl", "omni"])
def test_two_replicas_answer_like_one_engine(kind, setups):
    """Every case twice (the second round hits the replicas' prefix caches), token for token."""
    s = setups(kind)
    assert len({tuple(r) for r in s.refs}) == len(s.refs), "the tiny model should answer each input differently"
    first = s.llm.generate(s.prompts, GREEDY, use_tqdm=False)
    second = s.llm.generate(s.prompts, GREEDY, use_tqdm=False)
    assert tokens(first) == s.refs and tokens(second) == s.refs
    stats = s.engine.get_stats()
    assert all(r.prefix_cache_query_tokens > 0 for r in stats.replicas), "both replicas served requests"
    assert stats.prefix_cache_hit_tokens > 0
    assert s.engine.input_modalities == s.single.llm_engine.input_modalities
    assert_nothing_held(s.engine)


def test_the_second_turn_goes_to_the_replica_holding_the_first(setups):
    """Turn 1 of A then B lands on replicas 0 and 1 (least loaded); B's turn 2,
    with both replicas idle (least loaded would say 0), goes to B's replica and
    hits there: that replica's hit tokens cover turn 1, the other's do not move."""
    engine = setups("vl").engine
    a1 = engine.process_inputs("A1", "conversation A opens with a question about boats and harbours")
    b1 = engine.process_inputs("B1", "conversation B opens with a question about trains and stations")
    for rid, inputs in (("A1", a1), ("B1", b1)):
        engine.add_request(rid, inputs, GREEDY)
    assert (engine.replica_of("A1"), engine.replica_of("B1")) == (0, 1)
    b1_out = next(o for o in drain(engine) if o.request_id == "B1" and o.finished)
    turn2 = b1.prompt_token_ids + b1_out.outputs[0].token_ids + b1.prompt_token_ids[:5]
    before = [r.prefix_cache_hit_tokens for r in engine.get_stats().replicas]
    engine.add_request("B2", {"prompt_token_ids": turn2}, GREEDY)
    assert engine.replica_of("B2") == 1
    b2_out = next(o for o in drain(engine) if o.request_id == "B2" and o.finished)
    after = [r.prefix_cache_hit_tokens for r in engine.get_stats().replicas]
    assert after[0] == before[0]
    assert after[1] - before[1] >= len(b1.prompt_token_ids) // 4 * 4
    assert b2_out.num_cached_tokens == after[1] - before[1]
    assert_nothing_held(engine)


def test_abort_releases_what_every_replica_holds(setups):
    """Requests aborted mid-prefill and mid-decode on both replicas: no output
    for them afterwards, nothing held anywhere, and the ids can be reused."""
    s = setups("vl")
    engine = s.engine
    long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ids = [f"ab{i}" for i in range(4)]
    for rid, prompt in zip(ids, s.prompts[:4], strict=True):
        engine.add_request(rid, prompt, long)
    assert {engine.replica_of(rid) for rid in ids} == {0, 1}
    for _ in range(3):
        engine.step()
    engine.abort_request(ids)
    assert not {o.request_id for o in drain(engine)} & set(ids)
    assert_nothing_held(engine)
    assert tokens(s.llm.generate(s.prompts[:2], GREEDY, use_tqdm=False)) == s.refs[:2]


def test_an_id_added_again_after_abort_gets_its_own_answer(setups, monkeypatch):
    """An id may be reused once its request was aborted, also while the old request's step
    is still running on the replica: that step's outputs are the old request's, never the
    new one's (the old one, done in that step, used to end the new one)."""
    import omnistage.engine.distributed.data_parallel as dp

    s = setups("vl")
    engine = s.engine
    old, new = list(range(200, 209)), list(range(220, 229))  # token prompts no cached prefix routes
    (ref,) = tokens(s.single.generate([{"prompt_token_ids": new}], GREEDY, use_tqdm=False))
    monkeypatch.setattr(dp, "_WAIT_S", 0.0)  # step() returns while the replica's step runs
    engine.add_request("again", {"prompt_token_ids": old}, SamplingParams(temperature=0.0, max_tokens=1))
    replica = engine.replica_of("again")
    assert engine.step() == [] and engine._replicas[replica].stepping is not None  # the old step in flight
    engine.abort_request("again")
    engine.add_request("again", {"prompt_token_ids": new}, GREEDY)
    assert engine.replica_of("again") == replica
    outs = [o for o in drain(engine) if o.request_id == "again"]
    assert outs and all(list(o.prompt_token_ids) == new for o in outs)
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == ref
    assert_nothing_held(engine)


def test_a_stalled_replica_never_stalls_stats(setups):
    """A replica that does not answer (stopped here) is left out of get_stats / held after a
    bound, instead of blocking the caller (the server's engine thread) until it wakes."""
    import os
    import signal
    import time

    s = setups("vl")
    engine = s.engine
    before = engine.get_stats()
    pid = ray.get(engine.actor(1).pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        stats = engine.get_stats()
        waited = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert waited < 10 and [load.alive for load in stats.replicas] == [True, False]
    # Its counters stand as last reported (a total that went back would read as a reset); gauges drop it.
    assert stats.prefix_cache_query_tokens == before.prefix_cache_query_tokens > 0
    assert stats.replicas[1].prefix_cache_query_tokens == before.replicas[1].prefix_cache_query_tokens
    assert stats.kv_blocks_total < before.kv_blocks_total
    assert [load.alive for load in engine.get_stats().replicas] == [True, True]


def test_a_killed_replica_fails_only_its_requests(setups):
    """Four requests stream on two replicas; a fifth is routed but has streamed
    nothing when its replica is killed: that replica's streamed requests fail
    naming it, the fifth moves and answers, the other replica's answer as the
    single engine does; the survivor serves new requests and holds nothing."""
    s = setups("omni")
    engine = s.engine
    # Long answers, so every request is still running when all have streamed
    # (replicas step at their own pace: a short one could finish first).
    long = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    refs = tokens(s.single.generate(s.prompts[:4], long, use_tqdm=False))
    ids = [f"x{i}" for i in range(4)]
    for rid, prompt in zip(ids, s.prompts[:4], strict=True):
        engine.add_request(rid, prompt, long)
    streamed: set[str] = set()
    outputs: dict[str, Any] = {}
    while streamed != set(ids):
        for out in engine.step():
            outputs[out.request_id] = out
            if out.outputs[0].token_ids:
                streamed.add(out.request_id)
    assert not any(o.finished for o in outputs.values()), "max_tokens leaves them running"
    engine.add_request("late", s.prompts[0], long)
    victim = engine.replica_of("late")
    on_victim = {rid for rid in ids if engine.replica_of(rid) == victim}
    assert on_victim and on_victim != set(ids)
    ray.kill(engine.actor(victim), no_restart=True)
    for out in drain(engine):
        outputs[out.request_id] = out
    for i, rid in enumerate(ids):
        out = outputs[rid]
        assert out.finished
        if rid in on_victim:
            assert out.error is not None and f"engine replica {victim} died after it streamed tokens" in out.error
            assert out.outputs[0].finish_reason == "error"
        else:
            assert out.error is None and out.outputs[0].token_ids == refs[i]
    assert outputs["late"].error is None and outputs["late"].outputs[0].token_ids == refs[0]
    assert engine.num_live_replicas == 1
    again = s.llm.generate(s.prompts[1:3], GREEDY, use_tqdm=False)
    assert tokens(again) == s.refs[1:3]
    assert_nothing_held(engine)
    assert list(engine.held()) == [f"replica{1 - victim}.engine", "router"]  # the dead one is not asked


def test_server_routes_around_the_dead_replica_and_reports_each(setups):
    """After the kill above: /health is ok, completions are served (a streamed
    chat equal to the whole one), /metrics has each replica's load, the dead one down."""
    s = setups("omni")
    engine = s.engine
    dead = next(i for i in range(2) if engine.get_stats().replicas[i].alive is False)
    app = build_app(EngineArgs(model=s.path), ServerOptions(stats_log_interval_s=None), engine_factory=lambda: engine)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.base_url, timeout=120) as http:
        assert http.get("/health").status_code == 200
        body = {"model": s.path, "prompt": s.prompts[4], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        chat = {"model": s.path, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        whole = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
            chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
        deltas = [json.loads(c[6:])["choices"][0]["delta"].get("content") or "" for c in chunks]
        assert "".join(deltas) == whole and sum(bool(d) for d in deltas) >= 1
        text = http.get("/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    assert samples[f'omnistage:replica_up{{replica="{dead}"}}'] == 0
    assert samples[f'omnistage:replica_up{{replica="{1 - dead}"}}'] == 1
    assert samples[f'omnistage:replica_prefix_cache_queries_total{{replica="{1 - dead}"}}'] > 0
    assert f'omnistage:replica_num_requests{{replica="{1 - dead}"}}' in samples
    # The server owned the engine: stopping it let go of the replicas' actors (a model and a device each).
    assert engine.num_live_replicas == 0
