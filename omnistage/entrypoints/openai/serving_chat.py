"""``POST /v1/chat/completions``: messages -> chat template -> engine -> choices.

Order of checks, each failing with its own 400: the model name, output
modalities, unsupported parameters, every message and content part (an image or
audio part is first checked against the model's input modalities, so audio sent
to a text model is reported as such whatever its bytes; only then decoded and
limit-checked), sampling values, the chat template, and finally the engine's own
checks (prompt length, token ids).

Audio output (omni checkpoints, ``modalities: ["text", "audio"]``): the answer
comes back as OpenAI's ``message.audio`` (base64 16-bit mono audio at the
model's rate, ``audio.format`` "wav" (default) or "pcm16", plus its
transcript, the same text as ``content``). Streams send the text as content
deltas and the audio as it is made: ``delta.audio`` pieces ``{"id" (one per
answer), "data", "transcript"}``, the transcript in the first piece ("" in the
others), then the finish chunk. Each piece's ``data`` is base64 of the next
bytes of one stream: raw PCM for "pcm16"; for "wav" one header of unknown
length (``streaming_wav_header``) and then raw PCM, never a header per piece.
Every piece but the last holds a multiple of 6 bytes (whole samples, no
base64 padding), so clients that concatenate the base64 strings work too.
The server always decodes speech in the vocoder's streaming chunks, streamed
or not, so the two answers to one request and seed have the same samples.
The server keeps no audio for later turns, so ``expires_at`` is the creation
time. ``audio`` may be omitted: the checkpoint's default voice, WAV.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from omnistage.engine.omni.stage_io import resolve_speaker
from omnistage.entrypoints.openai.engine_client import EngineError, RequestStream
from omnistage.entrypoints.openai.errors import APIError, bad_request
from omnistage.entrypoints.openai.media import decode_audio, load_image
from omnistage.entrypoints.openai.protocol import (
    AudioPart,
    ChatAudio,
    ChatAudioDelta,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    ImagePart,
    TextPart,
    TokenLogprob,
    TopLogprob,
    parse_content_part,
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
    new_id,
    prepare_on_engine,
    prompt_logprobs_of,
    record_finished,
    sse,
    template_kwargs,
    top_entries,
    until_disconnect,
    usage_of,
)
from omnistage.multimodal.media import encode_pcm16, encode_wav, streaming_wav_header
from omnistage.outputs import CompletionOutput, RequestOutput

ENDPOINT = "chat"
# Most audio bytes per streamed ``delta.audio`` piece (rounded down to a multiple of 6).
AUDIO_CHUNK_BYTES = 48 * 1024
AUDIO_FORMATS = ("wav", "pcm16")
# Pieces are cut at multiples of 6 bytes: whole 16-bit samples, and base64 without padding.
_PIECE_UNIT = 6


class ChatServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Any:
        ctx = self.ctx
        clock = TTFTClock(ctx)  # from here: parsing is done, everything after counts toward TTFT
        model = ctx.check_model(req.model)
        voice = self._check_modalities(req)
        self._check_unsupported(req)
        messages = await self._convert_messages(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # max_completion_tokens is the newer name; it wins when both are given.
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        speak = "audio" in (req.modalities or ())
        audio_format = req.audio.format if req.audio else "wav"
        prompt = await self._render(messages, req)
        # The rendered ids before media placeholders expand: exact for text, a lower bound with media.
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        num_prompt = len(prompt.get("prompt_token_ids") or ())
        check_context(
            ctx, num_prompt, max_tokens, req.min_tokens, max_tokens_param, "messages", req.truncate_prompt_tokens
        )
        params = build_sampling_params(req, max_tokens, logprobs)
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        request_id = new_id("chatcmpl")
        stream = await add_to_engine(ctx, request_id, prompt, params, "messages", voice=voice, speak=speak)
        if req.stream:
            speech = _AudioStream(new_id("audio"), audio_format) if speak else None
            return SSEResponse(self._stream(req, model, request_id, stream, clock, speech))
        disconnected, final = await until_disconnect(raw_request, self._collect(request_id, stream, clock))
        if disconnected:
            ctx.metrics.record_request(ENDPOINT, "aborted")
            return JSONResponse({}, status_code=499)  # nobody is left to read it
        record_finished(ctx, ENDPOINT, [final])
        audio = _audio_of(final, audio_format)
        response = ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=[self._choice(c, req, audio) for c in final.outputs],
            usage=usage_of([final]),
            prompt_logprobs=(
                None if req.prompt_logprobs is None
                else prompt_logprobs_of(ctx, final, req.prompt_logprobs)
            ),
        )
        return JSONResponse(response.model_dump())

    # ------------------------------------------------------------------ validation

    def _check_modalities(self, req: ChatCompletionRequest) -> str | None:
        """Refuse output settings the model cannot honour; return the voice asked for
        (None: the default), spelled as the model names it."""
        modalities = req.modalities or ["text"]
        missing = [m for m in modalities if m not in self.ctx.output_modalities]
        if missing:
            raise bad_request(
                f"Model {self.ctx.model_name!r} cannot produce {missing} output; it supports "
                f"modalities {sorted(self.ctx.output_modalities)}",
                param="modalities",
                code="unsupported_modality",
            )
        if req.audio is not None and "audio" not in modalities:
            raise bad_request("'audio' output settings require 'modalities' to include 'audio'", param="audio")
        if req.audio is None:
            return None
        if req.audio.format not in AUDIO_FORMATS:
            raise bad_request(
                f"Audio format {req.audio.format!r} is not supported; this server returns {list(AUDIO_FORMATS)}",
                param="audio.format",
                code="unsupported_audio_format",
            )
        try:  # as offline use resolves speakers: case-insensitively
            return resolve_speaker(req.audio.voice, dict.fromkeys(self.ctx.voices))
        except ValueError:
            raise bad_request(
                f"Unknown voice {req.audio.voice!r}; model {self.ctx.model_name!r} has voices {list(self.ctx.voices)}",
                param="audio.voice",
                code="unknown_voice",
            ) from None

    @staticmethod
    def _check_unsupported(req: ChatCompletionRequest) -> None:
        if req.tools:
            raise unsupported("tools", "tool calling is not implemented by this server")
        if req.tool_choice not in (None, "none", "auto"):
            raise unsupported("tool_choice", "tool calling is not implemented by this server")
        if req.response_format is not None and req.response_format.type != "text":
            raise unsupported("response_format", f"only type 'text' is accepted, got {req.response_format.type!r}")

    async def _convert_messages(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        """Validate every message and part; return template-ready ``{"role", "content"}`` dicts."""
        out: list[dict[str, Any]] = []
        for i, msg in enumerate(req.messages):
            param = f"messages[{i}]"
            if msg.tool_calls:
                raise unsupported(f"{param}.tool_calls", "tool calling is not implemented by this server")
            if msg.content is None:
                raise bad_request(f"{param}.content is required", param=f"{param}.content")
            if isinstance(msg.content, str):
                text: Any = msg.content
            else:
                parts = await self._convert_parts(msg.role, msg.content, param)
                if all(isinstance(p, str) for p in parts):
                    text = "\n".join(parts)
                else:  # media for a multimodal model: content parts, rendered by engine.encode_chat
                    text = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
            # Most chat templates know no 'developer' role; it is OpenAI's new name for 'system'.
            role = "system" if msg.role == "developer" else msg.role
            entry: dict[str, Any] = {"role": role, "content": text}
            if msg.name:
                entry["name"] = msg.name
            out.append(entry)
        return out

    async def _convert_parts(self, role: str, parts: list[dict[str, Any]], param: str) -> list[Any]:
        """Text parts as strings; decoded media as ``{"type": "image", "image": PIL}``
        / ``{"type": "audio", "audio": (samples, rate)}`` parts."""
        ctx = self.ctx
        texts: list[Any] = []
        for j, raw in enumerate(parts):
            part_param = f"{param}.content[{j}]"
            part = parse_content_part(raw, part_param)
            if isinstance(part, TextPart):
                texts.append(part.text)
                continue
            modality = "image" if isinstance(part, ImagePart) else "audio"
            if role != "user":
                raise bad_request(f"{part_param}: only user messages may hold {modality} parts, not {role!r}", param=part_param)
            # What the model takes comes first: audio sent to a text model is that,
            # whatever its bytes. Then decode (off the event loop: a large PNG takes a while).
            if modality not in ctx.input_modalities:
                raise bad_request(
                    f"{part_param}: model {ctx.model_name!r} does not accept {modality} input "
                    f"(it accepts {sorted(ctx.input_modalities)})",
                    param=part_param,
                    code="unsupported_modality",
                )
            if isinstance(part, ImagePart):
                item: Any = await asyncio.to_thread(
                    load_image, part.image_url.url, ctx.media_limits, f"{part_param}.image_url.url"
                )
            elif isinstance(part, AudioPart):
                audio = await asyncio.to_thread(
                    decode_audio, part.input_audio.data, part.input_audio.format, ctx.media_limits, f"{part_param}.input_audio"
                )
                item = (audio.samples, audio.sample_rate)
            # The engine's processor turns the item into placeholder tokens + encoder inputs.
            texts.append({"type": modality, modality: item})
        return texts

    async def _render(self, messages: list[dict[str, Any]], req: ChatCompletionRequest) -> dict[str, Any]:
        kwargs = template_kwargs(self.ctx, req.chat_template_kwargs, req.add_generation_prompt)

        def render(engine: Any) -> dict[str, Any]:
            return engine.encode_chat(messages, **kwargs)

        try:
            return await prepare_on_engine(self.ctx, render)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors (role order, bad kwargs) are the client's
            raise bad_request(f"Could not apply the chat template: {exc}", param="messages", code="invalid_messages") from None

    # ------------------------------------------------------------------ output

    async def _collect(self, request_id: str, stream: RequestStream, clock: TTFTClock) -> RequestOutput:
        last: RequestOutput | None = None
        try:
            async for out in stream:
                clock.saw(out)
                last = out
        except EngineError as exc:
            raise engine_failure(exc) from None
        finally:
            if not stream.finished:
                self.ctx.client.abort(request_id)
        assert last is not None
        return last

    def _logprobs(self, c: CompletionOutput, start: int, req: ChatCompletionRequest) -> ChatChoiceLogprobs | None:
        if not req.logprobs or c.logprobs is None:
            return None
        top_n = req.top_logprobs or 0
        tok = self.ctx.token_str
        content = []
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            s = tok(tid)
            content.append(
                TokenLogprob(
                    token=s,
                    logprob=clamp_logprob(entry.get(tid, float("-inf"))),
                    bytes=list(s.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(token=tok(t), logprob=clamp_logprob(lp), bytes=list(tok(t).encode("utf-8")))
                        for t, lp in top_entries(entry, top_n)
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)

    def _choice(self, c: CompletionOutput, req: ChatCompletionRequest, audio: tuple[str, bytes] | None) -> ChatChoice:
        spoken = None
        if audio is not None:  # audio is n=1 only, so it is this choice's
            audio_id, wav = audio
            data = base64.b64encode(wav).decode("ascii")
            spoken = ChatAudio(id=audio_id, data=data, expires_at=int(time.time()), transcript=c.text)
        return ChatChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text, audio=spoken),
            logprobs=self._logprobs(c, 0, req),
            finish_reason=c.finish_reason,
        )

    async def _stream(
        self,
        req: ChatCompletionRequest,
        model: str,
        request_id: str,
        stream: RequestStream,
        clock: TTFTClock,
        speech: _AudioStream | None,
    ) -> AsyncIterator[bytes]:
        ctx = self.ctx
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent_chars = [0] * req.n
        sent_tokens = [0] * req.n
        done = [False] * req.n

        def chunk(choices: list[ChatChunkChoice], usage: Any = None) -> bytes:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage))

        last: RequestOutput | None = None
        try:
            yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(req.n)])
            async for out in stream:
                clock.saw(out)
                last = out
                choices = []
                for c in out.outputs:
                    i = c.index
                    if done[i]:
                        continue
                    delta = c.text[sent_chars[i]:]
                    new_tokens = len(c.token_ids) - sent_tokens[i]
                    finished = c.finish_reason is not None
                    new_audio = speech is not None and speech.has_new(out)
                    if not delta and not new_tokens and not finished and not new_audio:
                        continue
                    lp = self._logprobs(c, sent_tokens[i], req) if new_tokens else None
                    sent_chars[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                    if speech is not None and (new_audio or finished):
                        # OpenAI's order: the text so far, then the audio, then the finish chunk.
                        if delta or lp is not None:
                            yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=delta or None), logprobs=lp)])
                        delta, lp = "", None
                        for piece in speech.pieces(out, c.text, finished):
                            yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(audio=piece))])
                        if not finished:
                            continue
                    choices.append(
                        ChatChunkChoice(index=i, delta=ChatDelta(content=delta or None), logprobs=lp, finish_reason=c.finish_reason)
                    )
                    done[i] = finished
                if choices:
                    yield chunk(choices)
            assert last is not None
            if include_usage:
                yield chunk([], usage_of([last]))
            record_finished(ctx, ENDPOINT, [last])
            yield SSE_DONE
        except EngineError as exc:
            ctx.metrics.record_request(ENDPOINT, "server_error")
            yield sse(engine_failure(exc).to_body())
            yield SSE_DONE
        finally:
            if not stream.finished:
                # The client went away (or we are shutting down): free the request's KV blocks now.
                ctx.client.abort(request_id)
                ctx.metrics.record_request(ENDPOINT, "aborted")


def _audio_of(out: RequestOutput, audio_format: str) -> tuple[str, bytes] | None:
    """A finished output's spoken answer as (audio id, bytes in ``audio_format``); None without audio."""
    if out.audio is None or out.sample_rate is None:
        return None
    audio: Any = out.audio
    data = encode_wav(audio, out.sample_rate) if audio_format == "wav" else encode_pcm16(audio)
    return new_id("audio"), data


class _AudioStream:
    """One streamed answer's audio: the chunks already sent, and the bytes held
    back until a piece can end on a multiple of 6 bytes."""

    def __init__(self, audio_id: str, audio_format: str) -> None:
        self.audio_id, self.format = audio_id, audio_format
        self.sent_chunks = 0
        self.held = b""
        self.started = False

    def has_new(self, out: RequestOutput) -> bool:
        return len(out.audio_chunks or ()) > self.sent_chunks

    def pieces(self, out: RequestOutput, transcript: str, final: bool) -> list[ChatAudioDelta]:
        """The ``delta.audio`` pieces for the chunks that arrived with ``out`` (and, when
        ``final``, everything held back); the first piece of the answer carries the transcript."""
        chunks = list(out.audio_chunks or ())
        data = b"".join(encode_pcm16(c) for c in chunks[self.sent_chunks :])
        self.sent_chunks = len(chunks)
        if not self.started and self.format == "wav":
            assert out.sample_rate is not None
            data = streaming_wav_header(out.sample_rate) + data
        data, self.held = self.held + data, b""
        if not final:
            keep = len(data) - len(data) % _PIECE_UNIT
            data, self.held = data[:keep], data[keep:]
        size = max(_PIECE_UNIT, AUDIO_CHUNK_BYTES // _PIECE_UNIT * _PIECE_UNIT)
        parts = [data[i : i + size] for i in range(0, len(data), size)]
        if not parts and final and not self.started:
            parts = [b""]  # an answer without audio still names its audio and transcript
        deltas = [ChatAudioDelta(id=self.audio_id, data=base64.b64encode(p).decode("ascii"), transcript="") for p in parts]
        if deltas and not self.started:
            deltas[0].transcript, deltas[0].expires_at = transcript, int(time.time())
            self.started = True
        return deltas
