"""The engine thread and its asyncio bridge, against a scripted fake engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omnistage.entrypoints.openai.engine_client import EngineClient, EngineDeadError, EngineStepError
from omnistage.outputs import CompletionOutput, RequestOutput


class FakeEngine:
    """One token per request per step; records the batch size of each step."""

    def __init__(self, fail_on_step: int | None = None) -> None:
        self.reqs: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.batch_sizes: list[int] = []
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.fail_on_step = fail_on_step

    def add_request(self, request_id, prompt, params) -> None:
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        self.reqs[request_id] = []
        self.max_tokens[request_id] = params

    def abort_request(self, ids) -> None:
        self.thread_ids.add(threading.get_ident())
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.reqs.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.fail_on_step is not None and len(self.batch_sizes) == self.fail_on_step:
            raise RuntimeError("boom")
        self.batch_sizes.append(len(self.reqs))
        outs = []
        for rid, toks in list(self.reqs.items()):
            toks.append(len(toks))
            done = len(toks) >= self.max_tokens[rid]
            outs.append(
                RequestOutput(
                    request_id=rid,
                    prompt=None,
                    prompt_token_ids=[1],
                    outputs=[CompletionOutput(0, "x" * len(toks), list(toks), "length" if done else None)],
                    finished=done,
                )
            )
            if done:
                del self.reqs[rid]
        return outs

    def get_stats(self) -> dict:
        return {"num_running_reqs": len(self.reqs)}


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_requests_batch_and_run_on_one_thread() -> None:
    engine = FakeEngine()
    client = EngineClient(lambda: engine)
    client.start()
    try:

        async def one(i: int) -> RequestOutput:
            stream = await client.add_request(f"r{i}", "p", 5)
            last = None
            async for out in stream:
                last = out
            return last

        async def main():
            return await asyncio.gather(*(one(i) for i in range(8)))

        outs = _run(main())
        assert all(o.finished and len(o.outputs[0].token_ids) == 5 for o in outs)
        assert max(engine.batch_sizes) > 1  # requests from many callers share steps
        assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
        assert client.call_sync(lambda e: e.get_stats()) == {"num_running_reqs": 0}
    finally:
        client.shutdown()


def test_add_error_reaches_caller_and_loop_keeps_serving() -> None:
    engine = FakeEngine()
    client = EngineClient(lambda: engine)
    client.start()
    try:

        async def main():
            with pytest.raises(ValueError, match="empty"):
                await client.add_request("bad", "", 3)
            stream = await client.add_request("good", "p", 3)
            return [o async for o in stream][-1]

        assert _run(main()).finished
        assert client.is_healthy
    finally:
        client.shutdown()


def test_abort_frees_the_request() -> None:
    engine = FakeEngine()
    client = EngineClient(lambda: engine)
    client.start()
    try:

        async def main():
            stream = await client.add_request("long", "p", 10_000)
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            client.abort("long")
            for _ in range(200):
                if not await client.call(lambda e: e.has_unfinished_requests()):
                    return
                await asyncio.sleep(0.01)

        _run(main())
        assert engine.aborted == ["long"] and not engine.reqs
    finally:
        client.shutdown()


def test_step_failure_fails_requests_and_keeps_serving() -> None:
    engine = FakeEngine(fail_on_step=2)
    client = EngineClient(lambda: engine)
    client.start()
    try:

        async def main():
            stream = await client.add_request("r", "p", 100)
            with pytest.raises(EngineStepError, match="boom"):
                async for _ in stream:
                    pass
            engine.fail_on_step = None
            stream = await client.add_request("after", "p", 3)
            return [o async for o in stream][-1]

        assert _run(main()).finished
        assert engine.aborted == ["r"]  # the failed request was freed in the engine
        assert client.is_healthy
    finally:
        client.shutdown()


class _AbortFails(FakeEngine):
    def abort_request(self, ids) -> None:
        raise RuntimeError("abort broke too")


def _fail_one_request(client: EngineClient) -> None:
    async def main():
        stream = await client.add_request("r", "p", 100)
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in stream:
                pass

    _run(main())


def _wait_until(predicate, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        threading.Event().wait(0.01)


def test_failed_cleanup_after_step_failure_rebuilds_the_engine() -> None:
    """The loop dies when the clean-up fails; the client builds a new engine and serves again."""
    built: list[FakeEngine] = []

    def factory() -> FakeEngine:
        built.append(_AbortFails(fail_on_step=2) if not built else FakeEngine())
        return built[-1]

    client = EngineClient(factory)
    client.start()
    _fail_one_request(client)
    _wait_until(lambda: len(built) == 2 and client.is_healthy)
    assert len(built) == 2 and client.is_healthy and client.engine is built[1]
    assert client.call_sync(lambda e: e is built[1])
    client.shutdown()


def test_a_rebuild_that_fails_leaves_the_client_dead() -> None:
    calls = {"n": 0}

    def factory() -> FakeEngine:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("the checkpoint is gone")
        return _AbortFails(fail_on_step=2)

    client = EngineClient(factory)
    client.start()
    _fail_one_request(client)
    _wait_until(lambda: not client.is_healthy and calls["n"] > 1)
    assert not client.is_healthy and "abort broke too" in repr(client.dead_reason)
    with pytest.raises(EngineDeadError):
        client.call_sync(lambda e: None)
    client.shutdown()


def test_startup_failure_raises_in_start() -> None:
    def broken():
        raise FileNotFoundError("no checkpoint at /nope")

    client = EngineClient(broken)
    with pytest.raises(FileNotFoundError, match="/nope"):
        client.start()


def test_a_caller_that_stops_waiting_hurts_nothing() -> None:
    """A stats call that times out while the engine is busy, and an add whose caller went
    away while it was queued, are dropped; the engine keeps serving what is in flight
    (before, settling their cancelled futures killed the engine loop)."""
    engine = FakeEngine()
    client = EngineClient(lambda: engine)
    client.start()
    gate = threading.Event()
    try:

        async def main():
            stream = await client.add_request("kept", "p", 5)
            busy = asyncio.ensure_future(client.call(lambda e: gate.wait(5)))  # holds the engine thread
            await asyncio.sleep(0.05)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.get_stats(), 0.05)
            gone = asyncio.ensure_future(client.add_request("gone", "p", 5))
            await asyncio.sleep(0.05)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            gate.set()
            await busy
            return [o async for o in stream][-1]

        assert _run(main()).finished
        assert client.is_healthy and client.dead_reason is None
        assert client.call_sync(lambda e: sorted(e.reqs)) == []  # "gone" never ran
        assert "gone" not in engine.max_tokens
    finally:
        client.shutdown()
