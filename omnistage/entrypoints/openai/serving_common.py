"""What chat and text completions share: the serving context, sampling
parameters, token strings for logprobs, usage, SSE framing and client
disconnects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omnistage.engine.input_processor import kept_prompt_tokens
from omnistage.entrypoints.openai.engine_client import EngineClient, EngineDeadError, EngineError, EngineStepError, RequestStream
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.media import MediaLimits
from omnistage.entrypoints.openai.metrics import ServerMetrics
from omnistage.entrypoints.openai.protocol import PromptLogprob, PromptLogprobs, PromptTokensDetails, UsageInfo
from omnistage.outputs import RequestOutput
from omnistage.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ServingContext:
    """Everything a request handler needs, fixed once the engine has started."""

    client: EngineClient
    model_names: list[str]
    model_root: str | None
    max_model_len: int | None
    media_limits: MediaLimits
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    input_modalities: frozenset[str] = frozenset({"text"})
    output_modalities: frozenset[str] = frozenset({"text"})
    voices: tuple[str, ...] = ()  # speaker names for audio output (omni checkpoints)
    # A request may bring its own chat template (chat_template_kwargs["chat_template"]); off by default:
    # the template is code the server runs, at whatever cost it sets.
    trust_request_chat_template: bool = False
    _token_strs: dict[int, str] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        if name is None or name in self.model_names:
            return name or self.model_name
        raise APIError(
            f"The model {name!r} does not exist; this server serves {self.model_names}",
            status_code=404,
            param="model",
            code="model_not_found",
        )

    def token_str(self, token_id: int) -> str:
        """Decoded text of one token (cached; decoding is read-only on the tokenizer,
        so doing it here, off the engine thread, is safe)."""
        s = self._token_strs.get(token_id)
        if s is None:
            tok = self.client.engine.tokenizer
            s = tok.decode([token_id], skip_special_tokens=False)
            if len(self._token_strs) < 1_000_000:
                self._token_strs[token_id] = s
        return s


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Below this a temperature is greedy (vLLM's threshold too): dividing float32
# logits by a few 1e-38 overflows them, and the softmax is one-hot long before.
GREEDY_TEMPERATURE = 1e-5

# The server's penalty fields and their neutral values, passed on only where
# SamplingParams has the field (the sampler gains them in a separate change).
_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_ignored_penalties_logged: set[str] = set()


def _penalty_kwargs(req: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, neutral in _PENALTIES.items():
        value = getattr(req, name)
        if value is None or value == neutral:
            continue
        if name in _PARAM_FIELDS:
            out[name] = value
        elif name not in _ignored_penalties_logged:
            _ignored_penalties_logged.add(name)
            logger.warning("%s is accepted but not applied: SamplingParams has no such field yet", name)
    return out


def build_sampling_params(req: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """Map request fields onto ``SamplingParams``; unsupported knobs must be neutral."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("'prompt_logprobs' is not returned in a stream: send it with 'stream' false",
                          param="prompt_logprobs")  # fmt: skip
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        return SamplingParams(
            n=req.n,
            temperature=0.0 if temperature < GREEDY_TEMPERATURE else temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=req.logit_bias or None,
            prompt_logprobs=req.prompt_logprobs,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            **_penalty_kwargs(req),
        )
    except ValueError as exc:
        # "SamplingParams.top_k must be ..." -> param "top_k"
        msg = str(exc)
        param = msg.split(" ", 1)[0].removeprefix("SamplingParams.") if msg.startswith("SamplingParams.") else None
        raise bad_request(msg, param=param, code="invalid_value") from None


def check_context(
    ctx: ServingContext,
    num_prompt_tokens: int,
    max_tokens: int | None,
    min_tokens: int | None,
    max_tokens_param: str,
    prompt_param: str,
    truncate_prompt_tokens: int | None,
) -> None:
    """A 400 when the prompt leaves no room for what ``params`` ask (as OpenAI and vLLM
    answer), rather than a completion silently cut at the context's end.

    It runs on the request's own numbers, before they become ``SamplingParams``
    (whose range check would otherwise answer first, less helpfully).
    ``max_tokens`` (or ``min_tokens``) more than the context holds after the
    prompt is refused naming that field; an unset ``max_tokens`` means "up to
    the context" and needs no check. A prompt that fills the context alone is
    refused naming the prompt, as the engine would refuse it. The prompt is
    counted as ``truncate_prompt_tokens`` will leave it.
    """
    limit = ctx.max_model_len
    if limit is None:
        return
    num_prompt_tokens = kept_prompt_tokens(num_prompt_tokens, truncate_prompt_tokens, limit)
    if num_prompt_tokens >= limit:
        raise bad_request(
            f"The prompt ('{prompt_param}') has {num_prompt_tokens} tokens; this model's context holds {limit} "
            "tokens (max_model_len), which leaves no room to generate; shorten the prompt or set "
            "'truncate_prompt_tokens'",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = limit - num_prompt_tokens
    for param, asked in ((max_tokens_param, max_tokens), ("min_tokens", min_tokens)):
        if asked is not None and asked > room:
            raise bad_request(
                f"'{param}' is too large: {asked}. This model's context holds {limit} tokens (max_model_len) "
                f"and the prompt ('{prompt_param}') takes {num_prompt_tokens}, which leaves room for at most "
                f"{room} completion tokens; lower '{param}' or shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )


# chat_template_kwargs keys the server sets itself, which a request cannot.
_SERVER_TEMPLATE_KWARGS = ("tokenize", "conversation", "messages", "mm_processor_kwargs")


def template_kwargs(ctx: ServingContext, kwargs: dict[str, Any] | None, add_generation_prompt: bool) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` as the template gets them, with its
    ``add_generation_prompt`` (which the kwargs may override, as in vLLM); a 400 naming
    a key the server sets itself, or a template of the request's own unless the server
    trusts them (``--trust-request-chat-template``)."""
    kwargs = dict(kwargs or {})
    for key in _SERVER_TEMPLATE_KWARGS:
        if key in kwargs:
            raise bad_request(
                f"'chat_template_kwargs.{key}' cannot be set: the server renders the conversation itself",
                param=f"chat_template_kwargs.{key}",
            )
    if "chat_template" in kwargs and not ctx.trust_request_chat_template:
        raise bad_request(
            "'chat_template_kwargs.chat_template': this server does not take a chat template from a request "
            "(start it with --trust-request-chat-template to allow that); the model's own template applies",
            param="chat_template_kwargs.chat_template",
        )
    kwargs.setdefault("add_generation_prompt", add_generation_prompt)
    return kwargs


async def prepare_on_engine(ctx: ServingContext, fn: Any) -> Any:
    """``fn(engine)`` on the client's preparation thread (chat rendering, tokenizing); a 503
    while the engine is not running, so the client knows to retry."""
    try:
        return await ctx.client.prepare(fn)
    except EngineDeadError as exc:
        raise engine_unavailable(exc) from None


def engine_unavailable(exc: EngineDeadError) -> APIError:
    """A 503 for a request that arrives while the engine is not running (dead, rebuilding, stopping)."""
    return APIError(str(exc), status_code=503, type="server_error", code="engine_unavailable")


def engine_rejection(exc: ValueError, prompt_param: str) -> APIError:
    """A 400 for ``add_request`` refusing a request (too long, bad ids, bad params)."""
    msg = str(exc)
    lowered = msg.lower()
    named = next((p for p in ("logit_bias", "prompt_logprobs", "truncate_prompt_tokens") if p in lowered), None)
    if named is not None:
        param = named
    elif "logprobs" in lowered:
        param = "logprobs"
    elif "kv blocks" in lowered:  # the pool cannot hold prompt + max_tokens at once
        param = "max_tokens"
    elif "prompt" in lowered or "max_model_len" in lowered or "context" in lowered:
        param = prompt_param
    else:
        param = None
    code = "context_length_exceeded" if "max_model_len" in lowered or "context" in lowered else "invalid_value"
    return bad_request(msg, param=param, code=code)


async def add_to_engine(
    ctx: ServingContext,
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    prompt_param: str,
    voice: str | None = None,
    speak: bool = False,
) -> RequestStream:
    """Queue a request; ``speak`` asks an engine that can speak for audio in ``voice``
    (None: the model's default). An engine that speaks is told when not to.
    Speech is always decoded in the vocoder's streaming chunks, so an answer
    has the same samples streamed or not."""
    options: dict[str, Any] = {}
    if "audio" in ctx.output_modalities:
        options = {"return_audio": True, "speaker": voice, "stream_audio": True} if speak else {"return_audio": False}
    try:
        return await ctx.client.add_request(request_id, prompt, params, **options)
    except ValueError as exc:
        raise engine_rejection(exc, prompt_param) from None
    except EngineDeadError as exc:
        raise engine_unavailable(exc) from None


def engine_failure(exc: EngineError) -> APIError:
    """A 500 for a request the engine accepted and then failed (a failed step, a dead engine)."""
    code = "engine_step_failed" if isinstance(exc, EngineStepError) else "engine_dead"
    return APIError(str(exc), status_code=500, type="server_error", code=code)


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Prompt tokens count once per prompt (not per choice), like OpenAI."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def record_finished(ctx: ServingContext, endpoint: str, outputs: list[RequestOutput]) -> None:
    usage = usage_of(outputs)
    ctx.metrics.record_tokens(usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens)
    for o in outputs:
        for c in o.outputs:
            ctx.metrics.record_finish(c.finish_reason)
        ctx.metrics.record_latencies(o)
    ctx.metrics.record_request(endpoint, "success")


class TTFTClock:
    """Server-side time to first token: from reading the HTTP request to each of its prompts'
    first generated token (one sample per prompt, as the latency histograms count)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.start = time.monotonic()
        self.seen: set[str] = set()

    def saw(self, output: RequestOutput) -> None:
        if output.request_id not in self.seen and any(c.token_ids for c in output.outputs):
            self.seen.add(output.request_id)
            self.ctx.metrics.record_ttft(time.monotonic() - self.start)


def sse(obj: BaseModel | dict) -> bytes:
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json(exclude_none=False)
    else:
        payload = json.dumps(obj)
    return f"data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """Server-sent events whose producer is cancelled the moment the client leaves.

    Starlette's StreamingResponse (ASGI >= 2.4) notices a disconnect only when
    the next write fails, and leaves the generator to the garbage collector. A
    request still queued behind others writes nothing for a while, so here a
    watcher task races the producer and cancels it on ``http.disconnect``; the
    generator's ``finally`` then aborts the engine request and frees its blocks.
    """

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            results = await asyncio.gather(pump, watch, return_exceptions=True)
        exc = results[0]
        if isinstance(exc, BaseException) and not isinstance(exc, (asyncio.CancelledError, OSError)):
            raise exc

    async def _pump(self, send: Send) -> None:
        body = self.body_iterator
        try:
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await body.aclose()  # type: ignore[union-attr]


async def until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run ``work`` unless the client disconnects first; returns (disconnected, result).

    A non-streaming request has nothing to write until it finishes, so without
    this a client that gave up would keep its request generating (and holding
    KV blocks) to the end.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return True, None
    return False, task.result()


# OpenAI reports log-probabilities as finite numbers; -inf (a token the
# sampler filtered out) would not survive JSON.
_MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


def prompt_logprobs_of(ctx: ServingContext, out: RequestOutput, top_n: int) -> PromptLogprobs:
    """The response's ``prompt_logprobs`` (vLLM's shape): per prompt token after the first, the
    token and the ``top_n`` most likely at its position, keyed by token id, with ranks from 1
    (None for a prompt token outside those ``top_n``)."""
    result: PromptLogprobs = []
    for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
        if entry is None:
            result.append(None)
            continue
        ranked = top_entries(entry, len(entry))
        result.append({
            str(t): PromptLogprob(logprob=clamp_logprob(v), rank=r + 1 if r < top_n else None,
                                  decoded_token=ctx.token_str(t))
            for r, (t, v) in enumerate(ranked) if r < top_n or t == token
        })  # fmt: skip
    return result


def top_entries(entry: dict[int, float], top_n: int) -> list[tuple[int, float]]:
    """The ``top_n`` most likely tokens of one position, most likely first."""
    if top_n <= 0:
        return []
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_n]


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer below
            merged.put_nowait((i, exc))
        merged.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
