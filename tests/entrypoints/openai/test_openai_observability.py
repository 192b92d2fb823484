"""What the server tells its operator: latency histograms in /metrics, the
periodic stats line, 4xx reasons at DEBUG, /version, /tokenize, /detokenize."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time

import httpx
import pytest
from oai_helpers import TINY_MODEL_NAME, Server, metric_samples, start_server
from transformers import AutoTokenizer

import omnistage

MSG = [{"role": "user", "content": "what is the capital of france?"}]
HISTOGRAMS = ("e2e_request_latency_seconds", "time_per_output_token_seconds", "time_to_first_token_seconds")


def _sse_usage(resp: httpx.Response) -> dict:
    usage = None
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            usage = json.loads(line[6:]).get("usage") or usage
    return usage


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])


# --------------------------------------------------------------------------- /metrics


def test_latency_histograms_count_every_request(server: Server, http: httpx.Client) -> None:
    before = metric_samples(http.get("/metrics").text)
    common = {"model": server.model, "max_tokens": 5, "ignore_eos": True, "temperature": 0.0}
    opts = {"stream_options": {"include_usage": True}}
    requests = [
        ("/v1/chat/completions", {**common, "messages": MSG}),
        ("/v1/chat/completions", {**common, "messages": MSG, "stream": True, **opts}),
        ("/v1/completions", {**common, "prompt": "the quick brown fox"}),
        ("/v1/completions", {**common, "prompt": "jumps over", "stream": True, **opts}),
    ]
    for path, body in requests:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        usage = _sse_usage(r) if body.get("stream") else r.json()["usage"]
        assert usage["completion_tokens"] == 5
    after = metric_samples(http.get("/metrics").text)
    for name in HISTOGRAMS:
        full = f"omnistage:{name}"
        assert after[f"{full}_count"] - before[f"{full}_count"] == len(requests), name
        assert after[f"{full}_sum"] > before[f"{full}_sum"], name
        assert after[f'{full}_bucket{{le="+Inf"}}'] == after[f"{full}_count"]
    # TTFT and TPOT both fit inside the end-to-end latency of the same requests.
    e2e = after["omnistage:e2e_request_latency_seconds_sum"] - before["omnistage:e2e_request_latency_seconds_sum"]
    tpot = after["omnistage:time_per_output_token_seconds_sum"] - before["omnistage:time_per_output_token_seconds_sum"]
    assert 4 * tpot <= e2e


# --------------------------------------------------------------------------- /version, /tokenize, /detokenize


def test_version(http: httpx.Client) -> None:
    r = http.get("/version")
    assert r.status_code == 200
    assert r.json() == {"version": omnistage.__version__}
    assert omnistage.__version__ == importlib.metadata.version("omnistage")


def test_tokenize_prompt_matches_the_tokenizer(server: Server, http: httpx.Client, tokenizer) -> None:
    prompt = "Hello world, tokenize me!"
    for special in (True, False):
        r = http.post("/tokenize", json={"model": server.model, "prompt": prompt, "add_special_tokens": special})
        assert r.status_code == 200, r.text
        body = r.json()
        expected = tokenizer.encode(prompt, add_special_tokens=special)
        assert body["tokens"] == expected and body["count"] == len(expected)
        assert body["max_model_len"] == server.app.state.ctx.max_model_len
        assert "token_strs" not in body
    r = http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True})
    assert r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode(prompt))


def test_tokenize_chat_counts_what_a_chat_completion_sees(server: Server, http: httpx.Client, tokenizer) -> None:
    r = http.post("/tokenize", json={"model": server.model, "messages": MSG, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    body = r.json()
    rendered = tokenizer.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    chat = http.post("/v1/chat/completions", json={"model": server.model, "messages": MSG, "max_tokens": 1}).json()
    assert body["count"] == chat["usage"]["prompt_tokens"]
    # Text parts are joined like a chat completion joins them.
    parts = [{"role": "user", "content": [{"type": "text", "text": "what is the capital of france?"}]}]
    assert http.post("/tokenize", json={"messages": parts}).json()["tokens"] == body["tokens"]
    no_gen = http.post("/tokenize", json={"messages": MSG, "add_generation_prompt": False}).json()
    assert no_gen["count"] < body["count"]


def test_detokenize_round_trip(server: Server, http: httpx.Client, tokenizer) -> None:
    prompt = "Round trip: the quick brown fox."
    tokens = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    r = http.post("/detokenize", json={"model": server.model, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.decode(tokens)}
    assert r.json()["prompt"] == prompt


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "needle"),
    [
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]", "outside the vocabulary"),
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens[0]", "outside the vocabulary"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]", "integer"),
        ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]", "integer"),
        ("/detokenize", {"tokens": 3}, 400, "tokens", "list"),
        ("/detokenize", {}, 400, "tokens", "Missing"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", "string"),
        ("/tokenize", {}, 400, "prompt", "Missing"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", "boolean"),
        ("/tokenize", {"prompt": "x", "colour": 1}, 400, "colour", "Unrecognized"),
        ("/tokenize", {"messages": "hi"}, 400, "messages", "list"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400, "messages[0].content[0]", "text content only",
        ),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "does not exist"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", "does not exist"),
    ],
)
def test_tokenize_bad_input(http: httpx.Client, path, body, status, param, needle) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


# --------------------------------------------------------------------------- logs


def test_every_4xx_reason_is_logged_at_debug(server: Server, http: httpx.Client, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="omnistage.entrypoints.openai.api_server"):
        r = http.post("/v1/chat/completions", json={"model": server.model, "messages": MSG, "temperature": -1})
        assert r.status_code == 400
        missing = http.get("/v1/no-such-route")
        assert missing.status_code == 404
        ok = http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200
    lines = [rec for rec in caplog.records if rec.name == "omnistage.entrypoints.openai.api_server"]
    assert all(rec.levelno == logging.DEBUG for rec in lines)
    messages = [rec.getMessage() for rec in lines]
    err = r.json()["error"]
    assert any(
        m.startswith("400 POST /v1/chat/completions: ") and err["message"] in m and f"param={err['param']}" in m
        for m in messages
    ), messages
    assert any(m.startswith("404 GET /v1/no-such-route: ") for m in messages), messages
    assert len(lines) == 2  # the 200 logs nothing here


def test_periodic_stats_line(tiny_checkpoints, caplog) -> None:
    """A server with a 0.2 s interval: the lines' token counts add up to what the
    requests used, and an idle server stops logging."""
    interval = 0.2
    with caplog.at_level(logging.INFO, logger="omnistage.entrypoints.openai.stats_log"):
        thread, _ = start_server(tiny_checkpoints["llama"], TINY_MODEL_NAME, stats_log_interval_s=interval)
        try:
            time.sleep(3 * interval)
            assert not _stats_records(caplog, thread), "an idle server logged stats"
            prompt_tokens = generated = 0
            with httpx.Client(base_url=thread.base_url, timeout=60) as http:
                for n in (20, 3):  # prompt + max_tokens within the 256-token context
                    body = {"model": TINY_MODEL_NAME, "prompt": "count me " * n, "max_tokens": n, "ignore_eos": True}
                    usage = http.post("/v1/completions", json=body).json()["usage"]
                    prompt_tokens += usage["prompt_tokens"]
                    generated += usage["completion_tokens"]
            # Wait for the line that covers the last step (a busy machine may delay it).
            deadline = time.monotonic() + 10
            while sum(r.engine_stats.generation_tokens for r in _stats_records(caplog, thread)) < generated:
                assert time.monotonic() < deadline, "no stats line covered the requests' tokens"
                time.sleep(0.05)
            time.sleep(2 * interval)
            records = _stats_records(caplog, thread)
            settled = len(records)
            time.sleep(3 * interval)
            assert len(_stats_records(caplog, thread)) == settled, "an idle server kept logging"
        finally:
            thread.stop()
    windows = [r.engine_stats for r in records]
    assert settled >= 1
    assert sum(w.generation_tokens for w in windows) == generated
    assert sum(w.prompt_tokens for w in windows) == prompt_tokens
    assert windows[-1].running == 0 and windows[-1].waiting == 0 and windows[-1].kv_cache_usage == 0
    line = records[0].getMessage()
    assert line.startswith("engine: ") and "KV cache" in line and "prefix-cache hit rate" in line
    assert "generation" in line and "tokens/s" in line


def _stats_records(caplog, thread) -> list[logging.LogRecord]:
    """This server's stats lines: its stats task runs on its uvicorn thread (another test's server
    still alive in this process logs under the same logger)."""
    return [
        r for r in caplog.records
        if r.name == "omnistage.entrypoints.openai.stats_log" and r.levelno == logging.INFO
        and r.thread == thread.thread.ident
    ]  # fmt: skip


def test_stats_interval_flag() -> None:
    from omnistage.entrypoints.openai.cli_args import make_arg_parser, server_options_from

    assert server_options_from(make_arg_parser().parse_args([])).stats_log_interval_s == 10.0
    assert server_options_from(make_arg_parser().parse_args(["--stats-log-interval", "2.5"])).stats_log_interval_s == 2.5
    # vLLM's --disable-log-stats turns the line off.
    assert server_options_from(make_arg_parser().parse_args(["--disable-log-stats"])).stats_log_interval_s == 0
    assert server_options_from(make_arg_parser().parse_args(["--stats-log-interval", "0"])).stats_log_interval_s == 0
