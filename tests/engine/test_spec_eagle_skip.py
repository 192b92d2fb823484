"""The EAGLE head is skipped for requests that do not draft, and caught up when they do.

A random head (it agrees with the target almost never) stops drafting after
its first run, and the draft policy then only probes with back-off: between
probes the runner keeps the target's hidden states instead of running the
head (``worker/eagle_proposer.py``). Checked against a reference engine whose
window is 0 (the head runs over every verified token every step, as before):

- steps in which no request is asked for drafts, joins or leaves run no head
  at all;
- after the catch-ups (at a probe, a full window, and when a request leaves)
  the head's KV at every verified position equals the reference's, and every
  probe drafts what the reference drafts;
- outputs equal speculation off, and nothing is held afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_spec_eagle import _eagle, _tokens, targets  # noqa: F401  (targets is a fixture)
from utils_engine import PROMPTS, assert_pool_clean, make_engine, run_all

from omnistage.sampling_params import SamplingParams
from omnistage.worker.eagle_proposer import CATCH_UP_WINDOW

K = 3
LONG = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


class _Recorder:
    """Per step: the requests asked for drafts, whether any joined or left, the
    head's forward calls, the drafts proposed; and each request's last block ids."""

    def __init__(self, engine) -> None:
        self.steps: list[dict] = []
        self.block_ids: dict[str, list[int]] = {}
        runner = engine.runner
        self.calls = 0
        runner.proposer.head.register_forward_hook(self._count)
        execute = runner.execute_model

        def recorded(so):
            before = self.calls
            out = execute(so)
            batch = runner.input_batch
            for r, row in batch.req_id_to_index.items():
                self.block_ids[r] = batch.block_table[0].row_block_ids(row).tolist()
            self.steps.append({
                "asked": dict(so.draft_token_requests),
                "forward": bool(so.num_scheduled_tokens),
                "joins_or_leaves": bool(
                    so.scheduled_new_reqs or so.finished_req_ids or so.aborted_req_ids or so.preempted_req_ids
                ),
                "head_calls": self.calls - before,
                "drafts": dict(out.draft_token_ids or {}),
            })  # fmt: skip
            return out

        runner.execute_model = recorded

    def _count(self, *_):
        self.calls += 1


def _head_kv(engine, rec: _Recorder, req_id: str, num_positions: int) -> torch.Tensor:
    """The head's keys and values at a request's first ``num_positions`` positions."""
    proposer = engine.runner.proposer
    bs = proposer.block_size
    blocks = np.array(rec.block_ids[req_id])
    pos = np.arange(num_positions)
    slots = torch.from_numpy(blocks[pos // bs] * bs + pos % bs)
    cache = proposer.kv_caches[0]  # [2, Hkv, blocks, block_size, D]
    flat = cache.view(2, cache.shape[1], -1, cache.shape[-1])
    return flat.index_select(2, slots).clone()


def _run(loaded, head, window: int | None):
    engine = make_engine(loaded, speculative_config=_eagle(head, K))
    if window is not None:
        engine.runner.proposer.window = window
    rec = _Recorder(engine)
    outs = run_all(engine, PROMPTS, LONG)
    return engine, rec, outs


@pytest.mark.parametrize("window", [CATCH_UP_WINDOW, 5])
def test_head_skipped_between_probes_and_caught_up_exactly(window, targets):  # noqa: F811 (the imported fixture)
    loaded, head, _ = targets("llama", "random")
    off = _tokens(run_all(make_engine(loaded), PROMPTS, LONG))
    ref_engine, ref, ref_outs = _run(loaded, head, 0)  # the head over every verified token, every step
    engine, rec, outs = _run(loaded, head, window)
    assert _tokens(outs) == _tokens(ref_outs) == off
    assert engine.held().is_empty, engine.held()
    assert_pool_clean(engine)

    # Same probes, same drafts: the catch-up gave the head the context it would have had.
    assert [s["asked"] for s in rec.steps] == [s["asked"] for s in ref.steps]
    assert [s["drafts"] for s in rec.steps] == [s["drafts"] for s in ref.steps]
    assert sum(len(s["drafts"]) for s in rec.steps) >= 2 * len(PROMPTS)  # first runs and probes

    # The reference runs the head every step; here only where a request drafts, joins
    # or leaves, or (a small window) a window fills up.
    assert all(s["head_calls"] for s in ref.steps if s["forward"])
    idle = [s for s in rec.steps if s["forward"] and not s["asked"] and not s["joins_or_leaves"]]
    assert len(idle) > len(rec.steps) // 2
    idle_calls = sum(s["head_calls"] for s in idle)
    if window == CATCH_UP_WINDOW:
        assert idle_calls == 0
    else:  # one catch-up per request per `window` kept positions, at most
        assert 0 < idle_calls <= len(PROMPTS) * LONG.max_tokens // window
    assert rec.calls < ref.calls // 2

    # The head's KV at every verified position (all but the last sampled token) is the
    # reference's: nothing was lost to skipping (both engines allocate the same blocks).
    for i, o in enumerate(outs):
        n = len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1
        got = _head_kv(engine, rec, str(i), n)
        want = _head_kv(ref_engine, ref, str(i), n)
        assert rec.block_ids[str(i)] == ref.block_ids[str(i)]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_preemption_and_aborts_with_kept_rows_hold_nothing(targets):  # noqa: F811 (the imported fixture)
    """Requests preempted or aborted while their rows are kept: outputs still equal
    speculation off, drafts equal the every-step head's, and nothing is held after."""
    loaded, head, _ = targets("llama", "random")
    prompts = [f"{p} #{i}" for i in range(2) for p in PROMPTS]
    kwargs = {"block_size": 4, "num_kv_blocks": 40}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    off = _tokens(run_all(make_engine(loaded, **kwargs), prompts, params))
    runs = []
    for window in (0, CATCH_UP_WINDOW):
        engine = make_engine(loaded, speculative_config=_eagle(head, K), **kwargs)
        engine.runner.proposer.window = window
        rec = _Recorder(engine)
        assert _tokens(run_all(engine, prompts, params)) == off
        assert engine.get_stats().num_preemptions > 0
        runs.append([s["drafts"] for s in rec.steps])
        for i, p in enumerate(prompts):
            engine.add_request(f"abort{i}", p, params)
        for _ in range(12):  # past the first probes: rows are kept
            engine.step()
        assert window == 0 or engine.held().drafter_kept > 0
        engine.abort_request([f"abort{i}" for i in range(len(prompts))])
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.held().is_empty, engine.held()
        assert_pool_clean(engine)
    assert runs[0] == runs[1]
