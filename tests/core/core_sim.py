"""A fake worker for scheduler tests: plain-Python KV bookkeeping, no tensors.

It holds what a real worker would (rows, token ids, block tables) and checks
every ``SchedulerOutput`` against the contract: positions start at the sent
``num_computed_tokens``, block tables are append-only and cover the scheduled
tokens, and every KV slot a step reads holds the KV of exactly the right
prefix (a slot stores a fingerprint of the tokens up to its position), so a
wrong prefix-cache hit or a block reused too early fails loudly.

The sampled token is a fixed function of the tokens so far, so a request's
output does not depend on batching, chunking, preemption or caching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage.core.request import Request
from omnistage.core.sched_output import SchedulerOutput
from omnistage.core.scheduler import Scheduler
from omnistage.core.runner_output import ModelRunnerOutput


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': depends on every token so far; never 0..9."""
    return sum((i + 1) * t for i, t in enumerate(tokens)) % 89 + 11


def reference_output(prompt: list[int], num_out: int, sample: Callable[[list[int]], int] = next_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_out):
        tokens.append(sample(tokens))
    return tokens[len(prompt):]


@dataclass
class _Row:
    tokens: list[int]
    num_prompt: int
    block_ids: list[int]
    num_computed: int


@dataclass
class FakeWorker:
    block_size: int
    sample: Callable[[list[int]], int] = next_token
    rows: dict[str, _Row] = field(default_factory=dict)
    kv: dict[int, dict[int, tuple[int, ...]]] = field(default_factory=dict)  # block -> offset -> prefix
    steps: list[SchedulerOutput] = field(default_factory=list)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(out)
        for rid in out.finished_req_ids | out.aborted_req_ids | out.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows, f"{new.req_id} added twice"
            self.rows[new.req_id] = _Row(list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                                         new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            row = self.rows[cached.req_id]
            assert cached.num_computed_tokens == row.num_computed, cached
            row.block_ids.extend(cached.new_block_ids)
        assert set(out.num_scheduled_tokens) == {r.req_id for r in out.scheduled_new_reqs} | {
            r.req_id for r in out.scheduled_cached_reqs
        }
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        result = ModelRunnerOutput()
        for rid, n in out.num_scheduled_tokens.items():
            row = self.rows[rid]
            start, end = row.num_computed, row.num_computed + n
            assert n >= 1 and end <= len(row.tokens), (rid, start, n, len(row.tokens))
            assert len(row.block_ids) * self.block_size >= end, f"{rid}: block table too short"
            for pos in range(start):  # "attention" reads the whole prefix
                assert self._slot(row, pos) == tuple(row.tokens[: pos + 1]), f"{rid}: bad KV at {pos}"
            for pos in range(start, end):
                b = row.block_ids[pos // self.block_size]
                self.kv.setdefault(b, {})[pos % self.block_size] = tuple(row.tokens[: pos + 1])
            row.num_computed = end
            if end == len(row.tokens):
                token = self.sample(row.tokens)
                row.tokens.append(token)
                result.req_ids.append(rid)
                result.sampled_token_ids[rid] = token
        return result

    def _slot(self, row: _Row, pos: int) -> tuple[int, ...] | None:
        return self.kv.get(row.block_ids[pos // self.block_size], {}).get(pos % self.block_size)


def run_to_completion(sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000) -> dict[str, Request]:
    """Step until nothing is left; return every request that finished, by id."""
    done: dict[str, Request] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return done
        out = sched.schedule()
        assert not out.is_empty, "scheduler made no progress (deadlock)"
        arrivals = [r.arrival_time for r in [*sched.running, *sched.waiting]]
        assert arrivals == sorted(arrivals), "FCFS order broken"
        for req in sched.update_from_output(out, worker.execute(out)):
            if req.finished:
                done[req.request_id] = req
    raise AssertionError("did not finish within max_steps")


def assert_pool_clean(sched: Scheduler) -> None:
    """Nothing referenced: every block free, no request holds a table."""
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.req_to_blocks
    assert sched.get_stats().kv_blocks_used == 0
