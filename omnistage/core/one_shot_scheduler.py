"""The scheduler of a one-shot stage: each request runs once, first come first served."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from omnistage.core.request import Request, RequestStatus
from omnistage.core.runner_output import ModelRunnerOutput
from omnistage.core.sched_output import NewRequestData, SchedulerOutput
from omnistage.core.scheduler import SchedulerStats

__all__ = ["OneShotScheduler"]


class OneShotScheduler:
    """``Scheduler``'s interface for a stage with no KV cache and no autoregression
    (a vocoder): each step schedules up to ``max_requests_per_step`` waiting
    requests, oldest first, and each finishes in the step that runs it.

    A small number per step keeps the other stages of a pipeline stepping
    between these (often long) forwards.
    """

    def __init__(self, max_requests_per_step: int = 1) -> None:
        if max_requests_per_step < 1:
            raise ValueError(f"max_requests_per_step must be >= 1, got {max_requests_per_step}")
        self.max_requests_per_step = max_requests_per_step
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: dict[str, Request] = {}  # scheduled, until the step's output comes back
        self._finished: set[str] = set()  # since the last schedule, for the worker

    def add_request(self, request: Request) -> None:
        if request.request_id in self.waiting or request.request_id in self._running:
            raise ValueError(f"request {request.request_id!r}: a request with this id is already queued")
        self.waiting[request.request_id] = request

    def check_mm_items(self, request_id: str, features: list) -> None:
        """No media: nothing to check."""

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        ids = [req_ids] if isinstance(req_ids, str) else req_ids
        for rid in ids:
            request = self.waiting.pop(rid, None) or self._running.pop(rid, None)
            if request is not None:
                request.status = status

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self._running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self._running)

    def schedule(self) -> SchedulerOutput:
        new: list[NewRequestData] = []
        while self.waiting and len(new) < self.max_requests_per_step:
            _, request = self.waiting.popitem(last=False)
            request.status = RequestStatus.RUNNING
            new.append(NewRequestData(
                request.request_id, list(request.prompt_token_ids), request.num_prompt_tokens,
                request.sampling_params, [], 0, [], request.payload, request.return_hidden_states,
            ))  # fmt: skip
            self._running[request.request_id] = request
        out = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=[],
            num_scheduled_tokens={n.req_id: 1 for n in new},
            total_num_scheduled_tokens=len(new),
            finished_req_ids=self._finished,
        )
        self._finished = set()
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Every request run this step is done."""
        done = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = self._running.pop(rid, None)
            if request is None:
                continue  # aborted meanwhile
            request.status = RequestStatus.FINISHED_STOPPED
            self._finished.add(rid)
            done.append(request)
        return done

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self._running), num_waiting=len(self.waiting), kv_blocks_used=0, kv_blocks_total=0,
            prefix_cache_query_tokens=0, prefix_cache_hit_tokens=0, num_preemptions=0,
        )  # fmt: skip
