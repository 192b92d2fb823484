"""The scheduler of a chunked stage: a streaming vocoder decodes each request's
codes chunk by chunk, as they arrive, while the stage before it still makes them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from omnistage.core.chunk_schedule import ChunkSchedule
from omnistage.core.request import Request, RequestStatus
from omnistage.core.runner_output import ModelRunnerOutput
from omnistage.core.sched_output import ScheduledChunk, SchedulerOutput
from omnistage.core.scheduler import SchedulerStats

__all__ = ["ChunkedScheduler"]


@dataclass
class _Stream:
    request: Request
    schedule: ChunkSchedule
    codes: list[int]
    final: bool = False
    next_chunk: int = 0  # chunks decoded so far

    def ready(self) -> bool:
        return self.schedule.num_ready(len(self.codes), self.final) > self.next_chunk

    def empty_and_final(self) -> bool:
        return self.final and not self.codes


class ChunkedScheduler:
    """``Scheduler``'s interface for a stage whose requests grow while they run.

    A request is added with the codes known so far and its ``ChunkSchedule``
    (``request.payload.schedule``); ``extend_request`` hands it more codes, and
    finally says they are final. Each step schedules, oldest request first, one
    ready chunk each for up to ``max_requests_per_step`` requests; a request
    finishes in the step that decodes its last chunk (or, with no codes at all,
    in the step after it is told its codes are final). A request whose next
    chunk is not ready waits without being scheduled; it holds no KV.
    """

    def __init__(self, max_requests_per_step: int = 1) -> None:
        if max_requests_per_step < 1:
            raise ValueError(f"max_requests_per_step must be >= 1, got {max_requests_per_step}")
        self.max_requests_per_step = max_requests_per_step
        self.streams: dict[str, _Stream] = {}  # insertion order = arrival order
        self._finished: set[str] = set()  # since the last schedule, for the worker

    def add_request(self, request: Request) -> None:
        if request.request_id in self.streams:
            raise ValueError(f"request {request.request_id!r}: a request with this id is already queued")
        schedule = getattr(request.payload, "schedule", None)
        if not isinstance(schedule, ChunkSchedule):
            raise TypeError(f"request {request.request_id!r}: a chunked stage needs payload.schedule (a ChunkSchedule)")
        self.streams[request.request_id] = _Stream(request, schedule, list(request.prompt_token_ids))

    def extend_request(self, request_id: str, codes: list[int], final: bool) -> None:
        """The request's codes so far (a longer list than before, same prefix);
        ``final``: no more will come. Unknown ids (aborted) are ignored."""
        stream = self.streams.get(request_id)
        if stream is None:
            return
        if stream.final:
            raise ValueError(f"request {request_id!r}: its codes were already final")
        if len(codes) < len(stream.codes) or codes[: len(stream.codes)] != stream.codes:
            raise ValueError(f"request {request_id!r}: new codes must extend the {len(stream.codes)} known ones")
        stream.codes, stream.final = list(codes), final

    def check_mm_items(self, request_id: str, features: list) -> None:
        """No media: nothing to check."""

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        ids = [req_ids] if isinstance(req_ids, str) else req_ids
        for rid in ids:
            stream = self.streams.pop(rid, None)
            if stream is not None:
                stream.request.status = status
                self._finished.add(rid)  # the worker drops its decode state

    def has_unfinished_requests(self) -> bool:
        return bool(self.streams)  # those waiting for codes too (a step with nothing ready is empty)

    def get_num_unfinished_requests(self) -> int:
        return len(self.streams)

    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        for rid, stream in self.streams.items():
            if len(chunks) >= self.max_requests_per_step:
                break
            if stream.ready() or stream.empty_and_final():
                stream.request.status = RequestStatus.RUNNING
                total = stream.schedule.num_ready(len(stream.codes), stream.final)
                last = stream.final and stream.next_chunk + 1 >= total
                chunks.append(ScheduledChunk(rid, list(stream.codes), stream.next_chunk, last, stream.request.payload))
        out = SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=[],
            num_scheduled_tokens={c.req_id: 1 for c in chunks},
            total_num_scheduled_tokens=len(chunks),
            finished_req_ids=self._finished,
            scheduled_chunks=chunks,
        )
        self._finished = set()
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Every request that decoded a chunk; those that decoded their last are finished."""
        updated = []
        for chunk in scheduler_output.scheduled_chunks:
            stream = self.streams.get(chunk.req_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.next_chunk = chunk.index + 1
            if chunk.last:
                del self.streams[chunk.req_id]
                stream.request.status = RequestStatus.FINISHED_STOPPED
                self._finished.add(chunk.req_id)
            updated.append(stream.request)
        return updated

    def get_stats(self) -> SchedulerStats:
        running = sum(1 for s in self.streams.values() if s.next_chunk > 0)
        return SchedulerStats(
            num_running=running, num_waiting=len(self.streams) - running, kv_blocks_used=0, kv_blocks_total=0,
            prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0, num_preemptions=0,
        )  # fmt: skip
