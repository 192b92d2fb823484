"""The OpenAI-compatible HTTP server: FastAPI app, routes, auth, body limits.

``build_app(engine_args, options)`` returns an app whose lifespan starts the
engine thread (see ``engine_client``) and stops it; ``ServerThread`` runs that
app under uvicorn in a background thread for tests and benchmarks.
``python -m omnistage.entrypoints.openai.api_server`` and ``omnistage serve``
both end in ``serve_main`` (``cli_args``).

Besides the OpenAI routes: ``/health``, ``/metrics`` (Prometheus text),
``/version``, and vLLM's ``/tokenize`` and ``/detokenize``. While the engine
is busy a stats line is logged every ``stats_log_interval_s`` (see
``stats_log``); every 4xx answer is logged at DEBUG with its reason.

Bodies are read and parsed here, not by FastAPI, so malformed JSON, oversized
bodies and schema errors all come back in OpenAI's error format (400/413)
instead of FastAPI's 422 shape.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

import omnistage
from omnistage.entrypoints.openai.engine_client import EngineClient
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.media import DEFAULT_MAX_AUDIO_SECONDS, DEFAULT_MAX_IMAGE_PIXELS, server_media_limits
from omnistage.entrypoints.openai.metrics import normalize_engine_stats, replica_loads
from omnistage.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    parse_request,
)
from omnistage.entrypoints.openai.request_body import decode_json_body
from omnistage.entrypoints.openai.serving_chat import ChatServing
from omnistage.entrypoints.openai.serving_common import ServingContext
from omnistage.entrypoints.openai.serving_completions import CompletionServing
from omnistage.entrypoints.openai.serving_tokenize import DetokenizeRequest, TokenizeServing, parse_tokenize_request
from omnistage.entrypoints.openai.stats_log import DEFAULT_INTERVAL_S, StatsLogger

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclass
class ServerOptions:
    """Server-side settings (the engine's live in ``EngineArgs``)."""

    served_model_names: list[str] | None = None
    api_key: str | None = None
    allowed_local_media_path: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    stats_timeout_s: float = 10.0  # /metrics waits at most this long for the engine thread
    # Seconds between engine-stats log lines (logged only while busy); None or 0: no stats lines.
    stats_log_interval_s: float | None = DEFAULT_INTERVAL_S
    # Omni checkpoints: overrides of the talker's sampling (``TalkerParams`` fields), for every request.
    talker_params: dict[str, Any] | None = None
    # Requests may bring their own chat template (a template is code the server runs; off as in vLLM).
    trust_request_chat_template: bool = False


async def read_json_body(request: Request, limit: int) -> Any:
    """The request body as JSON, bounded by ``limit`` bytes (413 beyond it, chunked or not)."""
    declared = request.headers.get("content-length")
    too_large = APIError(
        f"Request body exceeds the limit of {limit} bytes", status_code=413, code="request_too_large"
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # counts chunked bodies too, which declare no length
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return decode_json_body(b"".join(chunks))  # depth, digits and Unicode checked there


def _default_engine_factory(engine_args: Any, options: ServerOptions) -> Callable[[], Any]:
    """The engine of the checkpoint (``build_engine``): one stage, or for a whole
    omni checkpoint (thinker, talker, token2wav) a pipeline that can also speak."""

    def make() -> Any:
        from omnistage.engine.factory import build_engine
        from omnistage.engine.omni.qwen2_5_omni import OmniOptions

        omni = OmniOptions(talker_params=options.talker_params) if options.talker_params else None
        return build_engine(engine_args, omni)

    return make


def _model_names(engine_args: Any, options: ServerOptions, engine: Any) -> list[str]:
    if options.served_model_names:
        return list(options.served_model_names)
    if getattr(engine_args, "model", None):
        return [str(engine_args.model)]
    loaded = getattr(engine, "loaded_model", None)
    return [str(getattr(loaded, "name", None) or "default")]


def build_app(
    engine_args: Any,
    options: ServerOptions | None = None,
    engine_factory: Callable[[], Any] | None = None,
) -> FastAPI:
    """The FastAPI app; its lifespan builds the engine in its own thread and stops it."""
    options = options or ServerOptions()
    client = EngineClient(engine_factory or _default_engine_factory(engine_args, options))
    limits = server_media_limits(
        allowed_local_media_path=options.allowed_local_media_path,
        max_image_pixels=options.max_image_pixels,
        max_audio_seconds=options.max_audio_seconds,
        max_media_bytes=options.max_request_body_bytes,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(client.start)
        engine = client.engine
        ctx = ServingContext(
            client=client,
            model_names=_model_names(engine_args, options, engine),
            model_root=str(getattr(engine_args, "model", None) or ""),
            max_model_len=getattr(engine, "max_model_len", None),
            media_limits=limits,
            # Multimodal / omni engines (later issues) declare what they take and give.
            input_modalities=frozenset(getattr(engine, "input_modalities", None) or {"text"}),
            output_modalities=frozenset(getattr(engine, "output_modalities", None) or {"text"}),
            voices=tuple(getattr(engine, "voices", None) or ()),
            trust_request_chat_template=options.trust_request_chat_template,
        )
        app.state.ctx = ctx
        app.state.chat = ChatServing(ctx)
        app.state.completions = CompletionServing(ctx)
        app.state.tokenize = TokenizeServing(ctx)
        stats_task = None
        if options.stats_log_interval_s:
            stats_logger = StatsLogger(options.stats_log_interval_s)
            stats_task = asyncio.create_task(stats_logger.run(client, options.stats_timeout_s))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await asyncio.to_thread(client.shutdown)

    app = FastAPI(title="omnistage OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_client = client
    app.state.options = options

    async def require_api_key(request: Request) -> None:
        if options.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not reveal how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise APIError(
                "Invalid or missing API key; send 'Authorization: Bearer <key>'",
                status_code=401,
                code="invalid_api_key",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @v1.get("/models")
    async def list_models(request: Request) -> JSONResponse:
        ctx: ServingContext = request.app.state.ctx
        cards = [ModelCard(id=n, root=ctx.model_root or n, max_model_len=ctx.max_model_len) for n in ctx.model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await read_json_body(request, options.max_request_body_bytes)
        req = parse_request(ChatCompletionRequest, body)
        return await request.app.state.chat.create(req, request)

    @v1.post("/completions")
    async def completions(request: Request) -> Any:
        body = await read_json_body(request, options.max_request_body_bytes)
        req = parse_request(CompletionRequest, body)
        return await request.app.state.completions.create(req, request)

    app.include_router(v1)

    # vLLM serves these outside /v1; the API key guards them too (they run in the engine thread).
    extra = APIRouter(dependencies=[Depends(require_api_key)])

    @extra.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_json_body(request, options.max_request_body_bytes)
        result = await request.app.state.tokenize.tokenize(parse_tokenize_request(body))
        return JSONResponse(result.model_dump(exclude_none=True))

    @extra.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_json_body(request, options.max_request_body_bytes)
        result = await request.app.state.tokenize.detokenize(parse_request(DetokenizeRequest, body))
        return JSONResponse(result.model_dump())

    app.include_router(extra)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": omnistage.__version__})

    @app.get("/health")
    async def health() -> Response:
        if client.is_healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": repr(client.dead_reason)}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx: ServingContext = request.app.state.ctx
        stats: Any = None
        if client.is_healthy:
            try:
                stats = await asyncio.wait_for(client.get_stats(), options.stats_timeout_s)
            except Exception:  # noqa: BLE001 - a busy or dead engine must not break scraping
                logger.warning("engine stats unavailable for /metrics", exc_info=True)
        return PlainTextResponse(
            ctx.metrics.render(normalize_engine_stats(stats), replica_loads(stats)),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    def record_error(request: Request, status: int) -> None:
        endpoint = _ENDPOINTS.get(request.url.path)
        ctx = getattr(request.app.state, "ctx", None)
        if endpoint and ctx is not None:
            ctx.metrics.record_request(endpoint, "client_error" if status < 500 else "server_error")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        record_error(request, exc.status_code)
        log_client_error(request, exc)
        return JSONResponse(exc.to_body(), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and wrong methods (405), in OpenAI's shape.
        err = APIError(str(exc.detail), status_code=exc.status_code, code=None)
        log_client_error(request, err)
        return JSONResponse(err.to_body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        record_error(request, 500)
        err = APIError(f"Internal server error: {type(exc).__name__}: {exc}", status_code=500, type="server_error")
        return JSONResponse(err.to_body(), status_code=500)

    return app


def log_client_error(request: Request, err: APIError) -> None:
    """One DEBUG line per 4xx: the access log shows only the status, this says why."""
    if 400 <= err.status_code < 500:
        logger.debug(
            "%d %s %s: %s (param=%s, code=%s)",
            err.status_code, request.method, request.url.path, err.message, err.param, err.code,
        )


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving ``app`` from a background thread (tests, benchmarks).

    ``with ServerThread(app) as srv: ... srv.base_url ...``; leaving the block
    runs the app's shutdown (engine thread stopped) before returning.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning") -> None:
        import uvicorn

        self.host = host
        self.port = port or find_free_port(host)
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="omnistage-uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 300.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    from omnistage.entrypoints.openai.cli_args import main

    main()
