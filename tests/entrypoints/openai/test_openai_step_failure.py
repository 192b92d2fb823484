"""A step that raises fails the requests in flight (500), frees what they held, and the
server keeps serving; a failed clean-up gets the engine rebuilt (503 meanwhile)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from oai_helpers import TINY_MODEL_NAME, Server, start_server

from omnistage.entrypoints.openai.engine_client import EngineDeadError


@pytest.fixture
def own_server(tiny_checkpoints) -> Iterator[Server]:
    """A server of its own: these tests break its engine on purpose."""
    thread, app = start_server(tiny_checkpoints["llama"], TINY_MODEL_NAME)
    try:
        yield Server(thread, app, TINY_MODEL_NAME)
    finally:
        thread.stop()


BODY = {"model": TINY_MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.0}
LONG = {**BODY, "max_tokens": 100, "ignore_eos": True}


def _hold_engine_thread(server: Server) -> threading.Event:
    """Park the engine thread in a call until the returned event is set, so that
    requests sent meanwhile enter the engine together, in one turn."""
    gate, parked = threading.Event(), threading.Event()

    def park(engine: Any) -> None:
        parked.set()
        gate.wait(30)

    threading.Thread(target=server.app.state.engine_client.call_sync, args=(park,), daemon=True).start()
    assert parked.wait(10)
    return gate


def _fail_next_step(monkeypatch: pytest.MonkeyPatch, engine: Any, also_break_abort: bool = False) -> list[int]:
    """Make the runner raise once, mid-step: after the scheduler allocated blocks."""
    runner = engine.runner
    real = runner.execute_model
    fired: list[int] = []

    def execute_model(sched_out: Any) -> Any:
        # A step that runs tokens: the engine also steps once with none, to drop ended rows.
        if not fired and sched_out.total_num_scheduled_tokens:
            fired.append(engine.get_num_unfinished_requests())
            raise RuntimeError("injected runner failure")
        return real(sched_out)

    monkeypatch.setattr(runner, "execute_model", execute_model)
    if also_break_abort:
        # The engine releases a failed step's requests itself, through its scheduler:
        # break that, so the clean-up fails inside the engine and after it.
        def abort_requests(ids: Any) -> None:
            raise RuntimeError("injected abort failure")

        monkeypatch.setattr(engine.scheduler, "abort_requests", abort_requests)
    return fired


def _send_both(server: Server) -> tuple[list[httpx.Response], list[bytes]]:
    """One non-streaming and one streaming completion, sent from threads."""
    plain: list[httpx.Response] = []
    streamed: list[bytes] = []

    def send_plain() -> None:
        plain.append(httpx.post(f"{server.v1}/completions", json=LONG, timeout=60))

    def send_stream() -> None:
        with httpx.stream("POST", f"{server.v1}/completions", json={**LONG, "stream": True}, timeout=60) as r:
            streamed.append(r.read())

    threads = [threading.Thread(target=f) for f in (send_plain, send_stream)]
    for t in threads:
        t.start()
    return plain, streamed, threads  # type: ignore[return-value]


def _wait_queued(server: Server, count: int) -> None:
    commands = server.app.state.engine_client._commands  # the adds wait behind the parked call
    deadline = time.monotonic() + 10
    while commands.qsize() < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert commands.qsize() >= count


def test_failed_step_fails_in_flight_requests_and_server_recovers(own_server: Server, monkeypatch) -> None:
    server = own_server
    reference = httpx.post(f"{server.v1}/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    engine = server.app.state.engine_client.engine

    gate = _hold_engine_thread(server)
    fired = _fail_next_step(monkeypatch, engine)
    plain, streamed, threads = _send_both(server)
    _wait_queued(server, 2)
    gate.set()
    for t in threads:
        t.join(60)

    assert fired == [2]  # both requests were in the failing step
    resp = plain[0]
    assert resp.status_code == 500, resp.text
    err = resp.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_step_failed"
    assert "engine step failed" in err["message"] and "injected runner failure" in err["message"]
    events = [line[len("data: "):] for line in streamed[0].decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    sse_err = json.loads(events[-2])["error"]
    assert sse_err["code"] == "engine_step_failed" and "injected runner failure" in sse_err["message"]

    stats = server.wait_idle()
    assert stats.kv_blocks_used == 0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    after = httpx.post(f"{server.v1}/completions", json=BODY, timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == reference
    assert server.wait_idle().kv_blocks_used == 0


def test_failed_cleanup_rebuilds_the_engine(own_server: Server, monkeypatch) -> None:
    """Issue 13: the server never answers 503 to everything while it lives. When even
    the clean-up after a failed step fails (KV blocks stay held), the request fails,
    /health says 503 while the engine is rebuilt, and then the server answers as before."""
    server = own_server
    client = server.app.state.engine_client
    reference = httpx.post(f"{server.v1}/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    broken = client.engine
    _fail_next_step(monkeypatch, broken, also_break_abort=True)
    resp = httpx.post(f"{server.v1}/completions", json=BODY, timeout=60)
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_step_failed"

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.base_url}/health")
        if health.status_code == 200 and client.engine is not broken:
            break
        time.sleep(0.05)
    assert health.json() == {"status": "ok"} and client.engine is not broken
    again = httpx.post(f"{server.v1}/completions", json=BODY, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference
    assert server.wait_idle().kv_blocks_used == 0


def test_requests_while_the_engine_is_down_get_503(own_server: Server, monkeypatch) -> None:
    """While the engine is not running (dead, being rebuilt, stopping), every route that needs it
    answers 503 engine_unavailable, the retryable status, including those whose preparation
    (chat rendering, tokenizing) runs before the engine sees the request."""
    server = own_server
    client = server.app.state.engine_client
    monkeypatch.setattr(client, "_dead", EngineDeadError("test: the engine is down"))
    chat = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    long_prompt = {**BODY, "prompt": "word " * 400}  # long enough that its length is checked by tokenizing
    routes = [
        ("/v1/chat/completions", chat),
        ("/v1/completions", BODY),
        ("/v1/completions", long_prompt),
        ("/tokenize", {"model": TINY_MODEL_NAME, "prompt": "hi"}),
        ("/tokenize", {"model": TINY_MODEL_NAME, "messages": chat["messages"]}),
        ("/detokenize", {"model": TINY_MODEL_NAME, "tokens": [1, 2, 3]}),
    ]
    for path, body in routes:
        resp = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert (resp.status_code, resp.json()["error"]["code"]) == (503, "engine_unavailable"), (path, resp.text)
    monkeypatch.undo()
    assert httpx.post(f"{server.v1}/completions", json=BODY, timeout=60).status_code == 200
