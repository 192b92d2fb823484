"""StepTensorCache: the tensor prefix cache driven by scheduler outputs, without a model.

Each test plays a runner's steps by hand: scheduler output -> ``begin_step``
-> batch update -> ``rows_added`` -> ``prepare_step`` -> write / merge / stage.
"""

from __future__ import annotations

import pytest
import torch

from omnistage.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from omnistage.sampling_params import SamplingParams
from omnistage.worker.input_batch import InputBatch
from omnistage.models.interface import NO_TENSOR_CACHE, TensorCachePolicy, tensor_cache_policy_of
from omnistage.worker.tensor_prefix_cache import StepTensorCache

BS = 4
FULL = TensorCachePolicy(full_prefix_hidden=True)


def new(req_id: str, num_tokens: int, blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, list(range(100, 100 + num_tokens)), num_tokens, SamplingParams(), blocks, computed)


def sched(new_reqs=(), cached=(), tokens=None, finished=(), aborted=(), preempted=()) -> SchedulerOutput:
    tokens = tokens or {}
    return SchedulerOutput(
        list(new_reqs), list(cached), dict(tokens), sum(tokens.values()),
        finished_req_ids=set(finished), aborted_req_ids=set(aborted), preempted_req_ids=set(preempted),
    )  # fmt: skip


class Runner:
    """The bookkeeping half of ModelRunner around a StepTensorCache."""

    def __init__(self, policy: TensorCachePolicy = FULL, num_blocks: int = 8, hidden: int = 2) -> None:
        self.batch = InputBatch(4, 64, BS)
        self.cache = StepTensorCache(policy, num_blocks, BS, hidden, torch.float32)

    def step(self, so: SchedulerOutput):
        self.cache.begin_step(so, self.batch)
        for rid in so.finished_req_ids | so.aborted_req_ids | so.preempted_req_ids:
            self.batch.remove_request(rid)
        for n in so.scheduled_new_reqs:
            self.batch.add_request(n.req_id, n.token_ids, n.num_prompt_tokens, n.num_computed_tokens, n.block_ids,
                                   n.sampling_params)  # fmt: skip
        for c in so.scheduled_cached_reqs:
            self.batch.update_request(c.req_id, c.new_block_ids, c.num_computed_tokens)
        self.cache.rows_added(so, so.fresh_block_ids(BS))
        return self.batch.prepare_step(so.num_scheduled_tokens) if so.num_scheduled_tokens else None

    def forward(self, step, base: float = 0.0):
        """Fake per-token rows: distinct values per token of the step."""
        states = base + torch.arange(step.num_tokens * 2, dtype=torch.float32).view(-1, 2)
        self.cache.write(step, states)
        return states

    def merge(self, step, states):
        return self.cache.merge(step, self.batch, states, list(range(len(step.req_ids))))


def test_a_model_that_declares_nothing_gets_no_cache() -> None:
    assert tensor_cache_policy_of(object()) is NO_TENSOR_CACHE
    assert not NO_TENSOR_CACHE.caches_anything
    with pytest.raises(ValueError, match="caches nothing"):
        StepTensorCache(NO_TENSOR_CACHE, 8, BS, 2, torch.float32)

    class Bad:
        tensor_cache_policy = "all"

    with pytest.raises(TypeError, match="expected a TensorCachePolicy"):
        tensor_cache_policy_of(Bad())


def test_hit_merges_cached_prefix_with_a_batch_row_that_is_not_scheduled() -> None:
    """``BatchStep.query_start_loc`` counts scheduled requests only; a request
    sitting unscheduled in row 0 must not shift the hit request's rows."""
    r = Runner()
    step = r.step(sched([new("x", 8, [0, 1])], tokens={"x": 8}))
    x_rows = r.forward(step, base=1000.0)
    assert torch.equal(r.merge(step, x_rows)["x"], x_rows)
    r.step(sched(finished={"x"}))
    step = r.step(sched([new("a", 3, [2])], tokens={"a": 3}))  # "a" takes row 0
    r.forward(step)
    # "b" repeats x's 8 tokens (hit on blocks 0, 1) and adds 2; "a" waits this step.
    step = r.step(sched([new("b", 10, [0, 1, 3], computed=8)], tokens={"b": 2}))
    assert step.req_ids == ["b"] and r.batch.req_id_to_index["b"] == 1
    b_rows = r.forward(step)
    merged = r.merge(step, b_rows)["b"]
    assert torch.equal(merged, torch.cat([x_rows, b_rows]))
    assert (r.cache.num_hit_requests, r.cache.num_hit_rows) == (1, 8)


def test_reallocated_blocks_are_invalidated_so_stale_rows_are_never_served() -> None:
    r = Runner()
    step = r.step(sched([new("x", 8, [0, 1])], tokens={"x": 8}))
    r.forward(step)
    r.step(sched(finished={"x"}))
    # Block 1 is evicted and given to "y" as a fresh block: its old rows are stale.
    step = r.step(sched([new("y", 2, [1])], tokens={"y": 2}))
    r.forward(step)
    # A (wrong) claim of a hit on block 1 must fail loudly, not return x's rows.
    step = r.step(sched([new("z", 10, [0, 1, 2], computed=8)], tokens={"z": 2}))
    with pytest.raises(RuntimeError, match="were not written"):
        r.merge(step, r.forward(step))


def test_deferred_rows_are_committed_on_finish_at_their_token_positions() -> None:
    """Two prefill chunks and a decode step, staged with the positions the step
    computed (``num_computed`` after the step), then written at finish."""
    r = Runner(TensorCachePolicy(deferred_keys=frozenset({"codes"})))
    chunks = []
    step = r.step(sched([new("r", 6, [0, 1])], tokens={"r": 4}))
    chunks.append(torch.full((4, 3), 1.0))
    r.cache.stage_deferred(step, r.batch, {"codes": chunks[-1]})
    step = r.step(sched(cached=[CachedRequestData("r", [], 4)], tokens={"r": 2}))
    chunks.append(torch.full((2, 3), 2.0))
    r.cache.stage_deferred(step, r.batch, {"codes": chunks[-1], "ignored": torch.zeros(2, 3)})
    assert r.cache.num_staged_requests == 1
    assert "codes" not in r.cache.cache.mm_outputs_cache  # nothing written before the finish
    r.step(sched(finished={"r"}))
    assert r.cache.num_staged_requests == 0
    rows = r.cache.cache.mm_outputs_cache["codes"].view(-1, 3)
    assert torch.equal(rows[:6], torch.cat(chunks))


@pytest.mark.parametrize("how", ["aborted", "preempted"])
def test_deferred_rows_of_aborted_or_preempted_requests_are_discarded(how: str) -> None:
    r = Runner(TensorCachePolicy(deferred_keys=frozenset({"codes"})))
    step = r.step(sched([new("r", 4, [0])], tokens={"r": 4}))
    r.cache.stage_deferred(step, r.batch, {"codes": torch.ones(4, 3)})
    r.step(sched(**{how: {"r"}}))
    assert r.cache.num_staged_requests == 0
    assert "codes" not in r.cache.cache.mm_outputs_cache


def test_memory_is_rows_plus_flags() -> None:
    r = Runner(num_blocks=10, hidden=6)
    assert r.cache.nbytes == 10 * BS * 6 * 4 + 10 * BS
    # A stage that hands no hidden states on (deferred keys only) keeps no hidden_size-wide rows.
    deferred_only = Runner(TensorCachePolicy(deferred_keys=frozenset({"codes"})), num_blocks=10, hidden=6)
    assert deferred_only.cache.nbytes == 10 * BS * 1 * 4 + 10 * BS


def test_thinker_runner_stages_and_commits_a_models_deferred_outputs(omni_model) -> None:
    """A thinker adapter that declares a deferred key gets it staged every step
    (after sampling) and written at its tokens' slots when the request finishes;
    an aborted request's staged rows are dropped unwritten."""
    import dataclasses

    from omnistage.engine.arg_utils import EngineArgs
    from omnistage.engine.stage import StageSpec
    from omnistage.engine.stage_engine import StageEngine
    from omnistage.models.qwen2_5_omni import ThinkerForTalkerAdapter

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, values) of every staged row

    class NextTokenAdapter(ThinkerForTalkerAdapter):
        tensor_cache_policy = TensorCachePolicy(full_prefix_hidden=True, deferred_keys=frozenset({"next"}))

        def deferred_outputs(self, step, hidden, out):
            # Row i: the token that follows token i (known only once the last one is sampled).
            ids = step.input_ids[: step.num_tokens].tolist()
            nxt = ids[1:] + [-1]
            for i, end in enumerate(step.query_start_loc[1:].tolist()):
                nxt[end - 1] = out.sampled_token_ids.get(step.req_ids[i], -1)
            values = torch.tensor(nxt, dtype=torch.float32)[:, None]
            seen.append((step.slot_mapping.clone(), values))
            return {"next": values}

    thinker = omni_model.thinker
    loaded = dataclasses.replace(thinker, mm_adapter=NextTokenAdapter(thinker.mm_adapter.model))
    args = EngineArgs(model=thinker.model_path, block_size=BS, max_model_len=128, num_kv_blocks=64)
    stage = StageEngine(args, loaded, StageSpec("thinker"))
    cache = stage.runner.tensor_cache
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    stage.add_request("keep", "a prompt of some twenty tokens", sp)
    stage.add_request("drop", "another prompt to abort", sp)
    for _ in range(3):  # both prefill in the first step, then decode
        stage.step()
    assert cache.num_staged_requests == 2
    stage.abort_request(["drop"])
    while stage.has_unfinished_requests():
        stage.step()
    assert cache.num_staged_requests == 0 and stage.held().is_empty
    rows, valid = cache.cache.mm_outputs_cache["next"].view(-1), cache.cache._mm["next"].valid.view(-1)
    slots = torch.cat([s for s, _ in seen])
    values = torch.cat([v for _, v in seen]).view(-1)
    written = valid[slots]
    assert written.any() and not written.all()  # "keep" committed, "drop" discarded
    known = written & (values >= 0)
    assert torch.equal(rows[slots[known]], values[known])
