"""One data-parallel replica: a whole engine (``build_engine``) inside a Ray actor.

The facade (``data_parallel.DataParallelEngine``) calls these methods
remotely; Ray runs one actor's calls in the order they were sent, so an
``add_request`` sent before a ``step`` is in that step. Nothing here raises
for a request: an ``add_request`` the engine refuses comes back as a failed
output with the next step, so the facade never waits on an add.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.core.block_pool import KVEvent
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.distributed.front import EngineFront
from omnistage.engine.stage import StageHeld
from omnistage.engine.stage_engine import EngineStats
from omnistage.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["EngineReplica", "ReplicaStep", "failed_output"]


@dataclass
class ReplicaStep:
    """What one replica step sends back: its outputs, the changes to its prefix
    cache's index (for the router), and whether it owes another step."""

    outputs: list[RequestOutput]
    kv_events: list[KVEvent] = field(default_factory=list)
    has_unfinished: bool = False


def failed_output(request_id: str, prompt: Any, n: int, error: str) -> RequestOutput:
    """A finished output with reason "error" on each of the ``n`` completions."""
    now = time.monotonic()
    return RequestOutput(
        request_id=request_id,
        prompt=getattr(prompt, "prompt_text", None),
        prompt_token_ids=list(getattr(prompt, "prompt_token_ids", None) or []),
        outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="error") for i in range(n)],
        finished=True,
        metrics=RequestMetrics(arrival_time=now, finished_time=now),
        error=error,
    )


class EngineReplica:
    """Holds one engine; the Ray actor class is ``ray.remote(EngineReplica)``."""

    def __init__(self, args: EngineArgs, options: Any = None) -> None:
        from omnistage.engine.factory import build_engine  # the factory builds replicas too

        self.engine = build_engine(dataclasses.replace(args, data_parallel_size=1), options)
        stage = getattr(self.engine, "thinker", self.engine)
        self._pool = stage.scheduler.kv_cache_manager.pool if hasattr(stage.scheduler, "kv_cache_manager") else None
        if self._pool is not None:
            self._pool.record_events()
        self._refused: list[RequestOutput] = []

    def front(self) -> EngineFront:
        return EngineFront.of(self.engine)

    def pid(self) -> int:
        return os.getpid()

    def add_request(self, request_id: str, inputs: Any, params: Any, options: dict[str, Any]) -> None:
        try:
            self.engine.add_request(request_id, inputs, params, **options)
        except Exception as exc:  # noqa: BLE001 - the request fails alone, with the next step
            n = getattr(params, "n", 1) or 1
            self._refused.append(failed_output(request_id, inputs, n, str(exc)))

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)

    def step(self) -> ReplicaStep:
        outputs, self._refused = self._refused, []
        if self.engine.has_unfinished_requests():
            outputs += self.engine.step()
        events = self._pool.take_events() if self._pool is not None else []
        return ReplicaStep(outputs, events, self.engine.has_unfinished_requests())

    def held(self) -> dict[str, StageHeld]:
        held = self.engine.held()
        return held if isinstance(held, dict) else {"engine": held}

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()
