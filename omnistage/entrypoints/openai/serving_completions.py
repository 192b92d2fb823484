"""``POST /v1/completions``: one or more prompts (text or token ids) -> choices.

Each prompt becomes one engine request (with ``n`` completions); its choices
are numbered ``prompt_index * n + completion_index`` as OpenAI does. All
prompts are admitted before any output is sent, so a bad second prompt fails
the whole call with a 400 and the first one is aborted, not left running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from omnistage.entrypoints.openai.engine_client import EngineError, RequestStream
from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    unsupported,
)
from omnistage.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServingContext,
    SSEResponse,
    TTFTClock,
    add_to_engine,
    build_sampling_params,
    check_context,
    clamp_logprob,
    engine_failure,
    merge_streams,
    new_id,
    prepare_on_engine,
    prompt_logprobs_of,
    record_finished,
    sse,
    top_entries,
    until_disconnect,
    usage_of,
)
from omnistage.outputs import CompletionOutput, RequestOutput

ENDPOINT = "completions"
MAX_PROMPTS = 256
_SPECIAL_TOKENS_SLACK = 16  # BOS/EOS and the like a tokenizer adds to a text


def salt_prompt(prompt: str | list[int], cache_salt: str | None) -> Any:
    """One prompt as the engine takes it, with the request's ``cache_salt`` when it has one."""
    if cache_salt is None:
        return prompt
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "cache_salt": cache_salt}


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """The four OpenAI prompt shapes as a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt")
    if isinstance(prompt[0], int):  # one prompt of token ids
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", param="prompt")
    return [p if isinstance(p, str) else list(p) for p in prompt]


_OutputView = Callable[[RequestOutput], RequestOutput]


def _as_is(out: RequestOutput) -> RequestOutput:
    return out


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """``out`` without the tokens its completions generated (``max_tokens`` 0 with ``echo``)."""
    completions = [
        dataclasses.replace(
            c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
            cumulative_logprob=None if c.logprobs is None else 0.0,
            finish_reason="length" if c.finished else None, stop_reason=None,
        )  # fmt: skip
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=completions)


class _ChoiceCursor:
    """What has been sent of one choice: characters, tokens, text offset for logprobs."""

    def __init__(self, offset: int) -> None:
        self.chars = 0
        self.tokens = 0
        self.text_offset = offset
        self.done = False


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest, raw_request: Request) -> Any:
        ctx = self.ctx
        clock = TTFTClock(ctx)  # from here: parsing is done, everything after counts toward TTFT
        model = ctx.check_model(req.model)
        if req.suffix:
            raise unsupported("suffix", "insertion (fill-in-the-middle) is not implemented")
        if req.best_of is not None and req.best_of != req.n:
            raise unsupported("best_of", "only best_of == n (or unset) is accepted")
        # max_tokens 0 with echo: the prompt (and its logprobs) alone, as OpenAI's legacy API and vLLM
        # answer it. The engine samples one token, which is not returned.
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise bad_request("'max_tokens' 0 asks for no completion: it needs 'echo' true", param="max_tokens")
        if echo_only and req.min_tokens:
            raise bad_request("'min_tokens' must be 0 when 'max_tokens' is 0", param="min_tokens")
        max_tokens = 1 if echo_only else req.max_tokens
        view = _prompt_only if echo_only else _as_is
        prompts = normalize_prompts(req.prompt)
        salted = [salt_prompt(p, req.cache_salt) for p in prompts]
        base_id = new_id("cmpl")
        ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        params_of = ["prompt" if len(prompts) == 1 else f"prompt[{i}]" for i in range(len(prompts))]
        await self._check_context(prompts, max_tokens, req, params_of)
        params = build_sampling_params(req, max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:  # the echoed prompt gets its logprobs too
            params = dataclasses.replace(params, prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))
        # Submit every prompt at once (the engine thread takes them in one turn),
        # then, if any was refused, abort the ones that got in.
        results = await asyncio.gather(
            *(add_to_engine(ctx, rid, p, params, param) for rid, p, param in zip(ids, salted, params_of)),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for rid, r in zip(ids, results):
                if not isinstance(r, BaseException):
                    ctx.client.abort(rid)
            raise failures[0]
        streams: list[RequestStream] = list(results)  # type: ignore[arg-type]
        echoes = [self._echo_text(p) if req.echo else "" for p in prompts]
        if req.stream:
            return SSEResponse(self._stream(req, model, base_id, ids, streams, echoes, clock, view))
        disconnected, finals = await until_disconnect(raw_request, self._collect(ids, streams, clock, view))
        if disconnected:
            ctx.metrics.record_request(ENDPOINT, "aborted")
            return JSONResponse({}, status_code=499)
        record_finished(ctx, ENDPOINT, finals)
        choices = [
            self._choice(p_idx * req.n + c.index, out, c, echoes[p_idx], req)
            for p_idx, out in enumerate(finals)
            for c in out.outputs
        ]
        response = CompletionResponse(id=base_id, model=model, choices=choices, usage=usage_of(finals))
        return JSONResponse(response.model_dump())

    async def _check_context(
        self, prompts: list[str | list[int]], max_tokens: int | None, req: CompletionRequest, params_of: list[str]
    ) -> None:
        """Refuse a prompt the context cannot hold (after ``truncate_prompt_tokens``), or
        ``max_tokens`` / ``min_tokens`` it cannot hold after the prompt.

        A text prompt is tokenized for this (on the front thread: a prompt of
        megabytes is refused without the engine thread ever reading it) only when
        its UTF-8 length says it might not fit: no tokenizer makes more tokens than
        bytes, plus a few special ones."""
        ctx = self.ctx
        min_tokens = req.min_tokens
        asked = max(max_tokens or 0, min_tokens or 0, 1)  # a prompt leaves room for at least one token
        if ctx.max_model_len is None:
            return
        counts: list[int | None] = [len(p) if isinstance(p, list) else None for p in prompts]
        unsure = [
            i for i, p in enumerate(prompts)
            if isinstance(p, str) and len(p.encode("utf-8")) + _SPECIAL_TOKENS_SLACK + asked > ctx.max_model_len
        ]
        if unsure:
            texts = [prompts[i] for i in unsure]
            lengths = await prepare_on_engine(ctx, lambda engine: [len(engine.tokenizer.encode(t)) for t in texts])
            for i, n in zip(unsure, lengths):
                counts[i] = n
        for n, param in zip(counts, params_of):
            if n is not None:
                check_context(ctx, n, max_tokens, min_tokens, "max_tokens", param, req.truncate_prompt_tokens)

    def _echo_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.ctx.client.engine.tokenizer.decode(prompt, skip_special_tokens=False)

    async def _collect(
        self, ids: list[str], streams: list[RequestStream], clock: TTFTClock, view: _OutputView
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                clock.saw(out)
                finals[i] = view(out)
        except EngineError as exc:
            raise engine_failure(exc) from None
        finally:
            for rid, s in zip(ids, streams):
                if not s.finished:
                    self.ctx.client.abort(rid)
        return [f for f in finals if f is not None]

    def _add_token(
        self, lp: CompletionLogprobs, token: int, entry: dict[int, float] | None, top_n: int, offset: int
    ) -> int:
        """One token's legacy logprobs (none for an echoed prompt's first token, whose ``entry`` is
        None) at text ``offset``; returns the offset after it."""
        tok = self.ctx.token_str
        s = tok(token)
        lp.tokens.append(s)
        if entry is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            lp.token_logprobs.append(clamp_logprob(entry.get(token, float("-inf"))))
            lp.top_logprobs.append({tok(t): clamp_logprob(v) for t, v in top_entries(entry, top_n)})
        lp.text_offset.append(offset)
        return offset + len(s)

    def _prompt_logprobs(self, out: RequestOutput, top_n: int) -> CompletionLogprobs:
        """Legacy logprobs of an echoed prompt (its tokens' offsets count from 0)."""
        lp, offset = CompletionLogprobs(), 0
        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
            offset = self._add_token(lp, token, entry, top_n, offset)
        return lp

    def _logprobs(
        self, c: CompletionOutput, cursor: _ChoiceCursor, top_n: int, lp: CompletionLogprobs | None = None
    ) -> CompletionLogprobs:
        """Legacy logprobs for the tokens after ``cursor.tokens`` (appended to ``lp``, the echoed
        prompt's, when given); advances the text offset."""
        lp = CompletionLogprobs() if lp is None else lp
        for token, entry in zip(c.token_ids[cursor.tokens:], (c.logprobs or [])[cursor.tokens:]):
            cursor.text_offset = self._add_token(lp, token, entry, top_n, cursor.text_offset)
        return lp

    def _choice(
        self, index: int, out: RequestOutput, c: CompletionOutput, echo: str, req: CompletionRequest
    ) -> CompletionChoice:
        lp = prompt_lps = None
        if req.logprobs is not None:
            prompt_lp = self._prompt_logprobs(out, req.logprobs) if req.echo else None
            lp = self._logprobs(c, _ChoiceCursor(len(echo)), req.logprobs, prompt_lp)
        if req.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_of(self.ctx, out, req.prompt_logprobs)
        return CompletionChoice(
            index=index, text=echo + c.text, logprobs=lp, finish_reason=c.finish_reason, prompt_logprobs=prompt_lps
        )

    async def _stream(
        self,
        req: CompletionRequest,
        model: str,
        base_id: str,
        ids: list[str],
        streams: list[RequestStream],
        echoes: list[str],
        clock: TTFTClock,
        view: _OutputView,
    ) -> AsyncIterator[bytes]:
        ctx = self.ctx
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        cursors: dict[int, _ChoiceCursor] = {}
        finals: list[RequestOutput | None] = [None] * len(streams)

        def chunk(choices: list[CompletionChoice], usage: Any = None) -> bytes:
            return sse(CompletionResponse(id=base_id, created=created, model=model, choices=choices, usage=usage))

        # An echo with logprobs waits for its prompt's logprobs, which come with the first output.
        echo_with_logprobs = req.echo and req.logprobs is not None
        try:
            if req.echo and not echo_with_logprobs:
                echo_choices = [
                    CompletionChoice(index=p * req.n + k, text=echo)
                    for p, echo in enumerate(echoes)
                    for k in range(req.n)
                    if echo
                ]
                if echo_choices:
                    yield chunk(echo_choices)
            async for p_idx, out in merge_streams(streams):
                clock.saw(out)
                finals[p_idx] = out = view(out)
                choices = []
                for c in out.outputs:
                    index = p_idx * req.n + c.index
                    lead, lead_lp = "", None  # the echoed prompt, sent with its choice's first output
                    cur = cursors.get(index)
                    if cur is None:
                        cur = cursors[index] = _ChoiceCursor(len(echoes[p_idx]))
                        if echo_with_logprobs:
                            lead, lead_lp = echoes[p_idx], self._prompt_logprobs(out, req.logprobs)
                    if cur.done:
                        continue
                    delta = c.text[cur.chars:]
                    new_tokens = len(c.token_ids) - cur.tokens
                    if not lead and not delta and not new_tokens and c.finish_reason is None:
                        continue
                    lp = lead_lp
                    if req.logprobs is not None and new_tokens:
                        lp = self._logprobs(c, cur, req.logprobs, lead_lp)
                    choices.append(
                        CompletionChoice(index=index, text=lead + delta, logprobs=lp, finish_reason=c.finish_reason)
                    )
                    cur.chars, cur.tokens = len(c.text), len(c.token_ids)
                    cur.done = c.finish_reason is not None
                if choices:
                    yield chunk(choices)
            done = [f for f in finals if f is not None]
            if include_usage:
                yield chunk([], usage_of(done))
            record_finished(ctx, ENDPOINT, done)
            yield SSE_DONE
        except EngineError as exc:
            ctx.metrics.record_request(ENDPOINT, "server_error")
            yield sse(engine_failure(exc).to_body())
            yield SSE_DONE
        finally:
            unfinished = [rid for rid, s in zip(ids, streams) if not s.finished]
            for rid in unfinished:
                ctx.client.abort(rid)
            if unfinished:
                ctx.metrics.record_request(ENDPOINT, "aborted")
