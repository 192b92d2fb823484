"""The chunked stage's scheduler: a request's codes arrive while it runs; each
step decodes one ready chunk per request, oldest first, and the request ends
with its last chunk (or is aborted, anywhere in between)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from omnistage.core.chunk_schedule import ChunkSchedule
from omnistage.core.chunked_scheduler import ChunkedScheduler
from omnistage.core.request import Request, RequestStatus
from omnistage.core.runner_output import ModelRunnerOutput
from omnistage.sampling_params import SamplingParams

SCHEDULE = ChunkSchedule(first=2, size=3, lookahead=1)  # chunks end at 2, 5, 8, ...


@dataclass
class Payload:
    schedule: ChunkSchedule


def _request(rid: str, codes: list[int], schedule: ChunkSchedule = SCHEDULE) -> Request:
    return Request(rid, list(codes), SamplingParams(), payload=Payload(schedule))


def _step(sched: ChunkedScheduler) -> list[tuple[str, int, bool, int]]:
    """One step: (request, chunk index, last, codes seen) per scheduled chunk."""
    so = sched.schedule()
    done = sched.update_from_output(so, ModelRunnerOutput())
    assert [r.request_id for r in done] == [c.req_id for c in so.scheduled_chunks]
    return [(c.req_id, c.index, c.last, len(c.codes)) for c in so.scheduled_chunks]


def test_chunks_are_scheduled_as_the_codes_arrive() -> None:
    sched = ChunkedScheduler(max_requests_per_step=4)
    req = _request("a", [1])
    sched.add_request(req)
    assert _step(sched) == []  # 1 code: chunk 0 (ends at 2) needs 3
    sched.extend_request("a", [1, 2, 3], final=False)
    assert _step(sched) == [("a", 0, False, 3)] and _step(sched) == []
    sched.extend_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], final=False)  # chunks 1 (ends 5) and 2 (ends 8)
    assert _step(sched) == [("a", 1, False, 9)]  # one chunk per request per step
    assert _step(sched) == [("a", 2, False, 9)]
    sched.extend_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], final=True)
    assert _step(sched) == [("a", 3, True, 10)]
    assert req.status is RequestStatus.FINISHED_STOPPED and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"a"}  # the worker drops its decode state


def test_oldest_first_and_a_cap_per_step() -> None:
    sched = ChunkedScheduler(max_requests_per_step=2)
    for rid in "abc":
        sched.add_request(_request(rid, [1, 2, 3, 4]))
    assert [c[0] for c in _step(sched)] == ["a", "b"]
    assert [c[0] for c in _step(sched)] == ["c"]  # a and b wait for codes: their chunk 1 needs 6


def test_whole_decode_and_no_codes() -> None:
    sched = ChunkedScheduler()
    sched.add_request(_request("whole", [1, 2, 3, 4, 5, 6, 7], ChunkSchedule()))
    sched.add_request(_request("silent", []))
    assert _step(sched) == []  # neither is final yet
    sched.extend_request("whole", [1, 2, 3, 4, 5, 6, 7], final=True)
    sched.extend_request("silent", [], final=True)
    assert _step(sched) == [("whole", 0, True, 7)]
    assert _step(sched) == [("silent", 0, True, 0)]  # ends with one empty chunk
    assert not sched.has_unfinished_requests()


def test_abort_anywhere_and_bad_updates() -> None:
    sched = ChunkedScheduler()
    req = _request("a", [1, 2, 3])
    sched.add_request(req)
    assert _step(sched) == [("a", 0, False, 3)]
    with pytest.raises(ValueError, match="must extend the 3 known ones"):
        sched.extend_request("a", [1, 9, 3, 4], final=False)
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request(_request("a", []))
    with pytest.raises(TypeError, match="payload.schedule"):
        sched.add_request(Request("b", [], SamplingParams()))
    sched.abort_requests("a")
    assert req.status is RequestStatus.FINISHED_ABORTED and sched.get_num_unfinished_requests() == 0
    sched.extend_request("a", [1, 2, 3, 4, 5, 6], final=True)  # late codes for an aborted request: ignored
    so = sched.schedule()
    assert so.scheduled_chunks == [] and so.finished_req_ids == {"a"}
    sched.add_request(_request("c", [1, 2, 3]))
    sched.extend_request("c", [1, 2, 3], final=True)
    with pytest.raises(ValueError, match="already final"):
        sched.extend_request("c", [1, 2, 3, 4], final=True)
