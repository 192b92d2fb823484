"""The asyncio face of the synchronous, thread-confined ``LLMEngine``.

One background thread owns the engine: it is built there, stepped there, and
every call into it (adding and aborting requests, chat templates, stats) runs
there. The thread drains a thread-safe command queue, calls ``step()`` while
any request is unfinished and blocks on the queue when idle. Requests arriving
over many connections therefore batch together in one step.

Results travel back through ``loop.call_soon_threadsafe``: one callback per
step delivers every new ``RequestOutput`` into its request's
``asyncio.Queue``. Outputs are cumulative (text, token ids, logprobs), so a
slow reader may skip intermediate ones and lose nothing: ``RequestStream``
always jumps to the newest output available.

Commands carry ``concurrent.futures.Future`` results, so the same calls serve
coroutines (``await``) and plain threads (tests, benchmarks) alike.

Prompts are prepared beside it: chat templates and tokenizing run on one
front thread (``prepare``), which reads only the engine's tokenizer and fixed
attributes, so rendering or counting a long prompt (megabytes that will be
refused) never holds up the steps that stream everyone else's tokens. The
tokenizer is shared with the engine thread's detokenizer: encoding and
decoding never change its state (no truncation or padding is ever set), so
they may run at once, as vLLM's front end and engine core do.

Failures: a ``step()`` that raises costs the requests in flight, not the
server. They end with ``EngineStepError`` and are aborted in the engine, which
frees their KV blocks and encoder entries, and the loop serves new requests.
The engine is marked dead (every later call fails with ``EngineDeadError``,
``/health`` answers 503) only when that clean-up fails: the abort raises, KV
blocks are still held afterwards, or a step fails with no request in flight
(nothing was left to blame, so the engine's own state is broken).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from omnistage.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """Why a request ended without a result: the server's fault, not the client's."""


class EngineDeadError(EngineError):
    """The engine thread stopped (recovery from a failed step failed, or the server is shutting down)."""


class EngineStepError(EngineError):
    """A step raised while the request was in flight; the request was aborted, the engine serves on."""


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: Any
    options: dict[str, Any]  # an omni engine's audio options (return_audio, speaker)
    stream: RequestStream
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _Stop:
    pass


class RequestStream:
    """The per-request mailbox the engine thread writes into."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:  # runs on the event loop
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            # Skip to the newest item: outputs are cumulative, and catching up
            # in one chunk beats sending a backlog of stale ones.
            while not self._queue.empty() and not isinstance(item, BaseException):
                item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item


class EngineClient:
    """Runs an engine in a background thread and exposes it to asyncio code.

    Failure policy: a request the engine fails alone gets its error and the
    others go on (the engine contains failed steps itself). Should the engine
    loop die anyway (its clean-up after a failure left KV blocks held), every
    request in flight and every queued command fails, and the engine is
    rebuilt from the factory; while it is rebuilt the client is unhealthy
    (503), then it serves again. Only a rebuild that fails leaves it dead.
    """

    def __init__(self, engine_factory: Callable[[], Any]) -> None:
        self._factory = engine_factory
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._dead: BaseException | None = None
        self.engine: Any = None  # read-only from other threads (attributes fixed after construction)
        self._front = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnistage-front")

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float | None = None) -> None:
        """Build the engine in its thread; re-raises a construction failure here."""
        self._thread = threading.Thread(target=self._run, name="omnistage-engine", daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self._startup_error is not None:
            raise self._startup_error
        if not self._ready.is_set():
            raise TimeoutError("the engine did not start in time")

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        self._thread = None
        self._front.shutdown(wait=False, cancel_futures=True)

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_reason(self) -> BaseException | None:
        return self._dead

    # ------------------------------------------------------------------ commands

    def _submit(self, cmd: Any) -> None:
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running ({self._dead!r})")
        self._commands.put(cmd)

    async def add_request(self, request_id: str, prompt: Any, params: Any, **options: Any) -> RequestStream:
        """Queue a request; returns once the engine accepted it (ValueError if it did not).
        ``options`` go to the engine's ``add_request`` as they are (an omni
        engine's ``return_audio``, ``speaker``)."""
        stream = RequestStream(request_id, asyncio.get_running_loop())
        cmd = _Add(request_id, prompt, params, options, stream)
        self._submit(cmd)
        try:
            await asyncio.wrap_future(cmd.done)
        except asyncio.CancelledError:
            # The caller went away while the add was queued: make sure the
            # request does not run (abort is a no-op if it never got in).
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Fire-and-forget: the engine frees the request's blocks on its next turn."""
        if self.is_healthy:
            self._commands.put(_Abort(request_id))

    def call_sync(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """Run ``fn(engine)`` in the engine thread and wait for its result (any thread)."""
        cmd = _Call(fn)
        self._submit(cmd)
        return cmd.done.result(timeout)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread (between steps) and await its result."""
        cmd = _Call(fn)
        self._submit(cmd)
        return await asyncio.wrap_future(cmd.done)

    async def prepare(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the front thread (see the module docstring): for work that
        reads only the tokenizer and the engine's fixed attributes (templates, tokenizing)."""
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running ({self._dead!r})")
        return await asyncio.get_running_loop().run_in_executor(self._front, fn, self.engine)

    async def get_stats(self) -> Any:
        return await self.call(lambda engine: engine.get_stats())

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - surfaced to start()
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            streams: dict[str, RequestStream] = {}
            try:
                self._loop(streams)
                self._release_engine()
                return  # stopped
            except BaseException as exc:  # noqa: BLE001 - a broken engine must fail its requests, not hang them
                logger.error("engine loop died: %s\n%s", exc, traceback.format_exc())
                self._dead = exc
                err = EngineDeadError(f"engine failed: {exc!r}")
                self._drain_after_death(err)
                self._deliver([(s, err) for s in streams.values()])
            self._release_engine()  # a new one may need what the old one holds (replicas' devices)
            try:
                logger.warning("rebuilding the engine")
                self.engine = self._factory()
            except BaseException as rebuild:  # noqa: BLE001 - nothing left to serve with
                logger.error("rebuilding the engine failed: %s\n%s", rebuild, traceback.format_exc())
                return
            self._drain_after_death(EngineDeadError("the engine was rebuilt; send the request again"))
            self._dead = None
            logger.warning("the engine was rebuilt and serves again")

    def _release_engine(self) -> None:
        """Let go of what the engine holds outside this process (data-parallel replicas'
        actors, each a whole model on its own device)."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - stopping must not fail on an engine already broken
                logger.warning("shutting the engine down failed", exc_info=True)

    def _drain_after_death(self, err: BaseException) -> None:
        """Fail commands still queued so no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(err)

    def _loop(self, streams: dict[str, RequestStream]) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            commands = [self._commands.get()] if idle else []  # block only when there is nothing to step
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if isinstance(cmd, _Stop):
                    self._abort_all(streams)
                    self._dead = EngineDeadError("the server is shutting down")
                    self._drain_after_death(self._dead)
                    return
                self._handle(cmd, streams)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - recovered below, or re-raised as fatal
                self._recover_from_step_failure(exc, streams)
                continue
            batch: list[tuple[RequestStream, RequestOutput | BaseException]] = []
            for out in outputs:
                stream = streams.get(out.request_id)
                if stream is None:
                    continue  # aborted by its client; nobody is listening
                if out.finished:
                    del streams[out.request_id]
                if out.error is not None:  # it failed alone inside the engine; the others go on
                    batch.append((stream, EngineStepError(f"{out.error}; the request was aborted")))
                else:
                    batch.append((stream, out))
            self._deliver(batch)

    def _recover_from_step_failure(self, exc: Exception, streams: dict[str, RequestStream]) -> None:
        """Fail and abort every request in flight; raise (the engine dies) if that cannot leave it clean."""
        logger.error(
            "engine step failed; failing %d request(s) in flight: %s\n%s", len(streams), exc, traceback.format_exc()
        )
        ids = list(streams)
        err = EngineStepError(f"the engine step failed ({type(exc).__name__}: {exc}); the request was aborted")
        # Callers first: they learn of the failure even if the clean-up below kills the engine.
        self._deliver([(s, err) for s in streams.values()])
        streams.clear()
        self.engine.abort_request(ids)
        held = _held_kv_blocks(self.engine)
        if held:
            raise RuntimeError(
                f"{held} KV blocks are still held after aborting every request in flight "
                f"(the step failed with {type(exc).__name__}: {exc})"
            ) from exc

    def _handle(self, cmd: Any, streams: dict[str, RequestStream]) -> None:
        engine = self.engine
        # A caller that stopped waiting (a timeout, a client gone) cancelled its command's future:
        # the command is dropped, and the engine never tries to settle a cancelled future. Marking
        # the others running means a late cancel can no longer change them.
        if isinstance(cmd, (_Add, _Call)) and not cmd.done.set_running_or_notify_cancel():
            return
        if isinstance(cmd, _Add):
            try:
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params, **cmd.options)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone; the loop keeps serving
                cmd.done.set_exception(exc)
                return
            streams[cmd.request_id] = cmd.stream
            cmd.done.set_result(None)
        elif isinstance(cmd, _Abort):
            if streams.pop(cmd.request_id, None) is not None:
                engine.abort_request([cmd.request_id])
        elif isinstance(cmd, _Call):
            try:
                cmd.done.set_result(cmd.fn(engine))
            except Exception as exc:  # noqa: BLE001 - returned to the caller
                cmd.done.set_exception(exc)

    def _abort_all(self, streams: dict[str, RequestStream]) -> None:
        if streams:
            try:
                self.engine.abort_request(list(streams))
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.exception("abort on shutdown failed")
            err = EngineDeadError("the server is shutting down")
            self._deliver([(s, err) for s in streams.values()])
            streams.clear()

    @staticmethod
    def _deliver(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """One thread-safe callback per event loop per step, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream, item in batch:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_on_loop, items)
            except RuntimeError:
                pass  # the loop closed (server shutting down); nobody is listening


def _held_kv_blocks(engine: Any) -> int:
    """KV blocks requests hold, in every stage of the engine (its stats' count for an
    engine that does not report what it holds)."""
    held_of = getattr(engine, "held", None)
    if held_of is None:
        return int(getattr(engine.get_stats(), "kv_blocks_used", 0) or 0)
    held = held_of()
    stages = held.values() if isinstance(held, dict) else [held]
    return sum(s.kv_blocks for s in stages)


def _deliver_on_loop(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)
