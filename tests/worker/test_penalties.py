"""Penalties and token masks, batched, against transformers' logits processors
and a plain reference of vLLM's presence / frequency semantics."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor

from omnistage.sampling_params import SamplingParams
from omnistage.worker.input_batch import InputBatch
from omnistage.worker.penalties import TokenHistory, apply_penalties
from omnistage.worker.sampler import Sampler, SamplingMetadata, SamplingState

V = 64
EOS = 5


def _reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row's logits after the rules: transformers' RepetitionPenaltyLogitsProcessor
    (prompt + output), vLLM's frequency then presence penalty (output only), then
    SuppressTokensLogitsProcessor and the allowed-ids mask."""
    x = logits.float().clone()[None]
    ids = torch.tensor([prompt + output])
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    freq = torch.tensor(p.frequency_penalty, dtype=torch.float32)
    pres = torch.tensor(p.presence_penalty, dtype=torch.float32)
    for token, count in Counter(output).items():
        if p.frequency_penalty:
            x[0, token] = x[0, token] - freq * count
        if p.presence_penalty:
            x[0, token] = x[0, token] - pres
    if p.suppress_token_ids:
        x = SuppressTokensLogitsProcessor(p.suppress_token_ids)(ids, x)
    if p.allowed_token_ids is not None:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x = x.masked_fill(~keep, float("-inf"))
    return x[0]


def _rules(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits the sampler draws from, before min_tokens masking and temperature."""
    x = logits.float()
    if md.penalties is not None:
        x = md.penalties.apply(x)
    if md.token_mask is not None:
        x = md.token_mask.apply(x)
    return x


class _Batch:
    """An InputBatch and a SamplingState kept in step, as the model runner keeps them."""

    def __init__(self, max_num_reqs: int = 10) -> None:
        self.batch = InputBatch(max_num_reqs, max_model_len=64, block_size=4)
        self.state = SamplingState(max_num_reqs, V, [EOS], torch.device("cpu"))
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams, output: list[int] = ()) -> None:
        """A new request, or a resumed one bringing its output so far."""
        self.prompts[req_id], self.outputs[req_id] = list(prompt), list(output)
        row = self.batch.add_request(req_id, list(prompt) + list(output), len(prompt), 0, [], params)
        self.state.set_row(row, params)

    def remove(self, req_id: str) -> None:
        row = self.batch.remove_request(req_id)
        if row is not None and row < self.batch.num_reqs:  # the last row moved into the hole
            moved = self.batch.req_ids[row]
            self.state.set_row(row, self.batch.sampling_params[moved])

    def step(self, logits: torch.Tensor, req_ids: list[str]) -> tuple[SamplingMetadata, list[int]]:
        rows = np.array([self.batch.req_id_to_index[r] for r in req_ids])
        md = self.state.metadata(self.batch, rows, req_ids)
        tokens = Sampler()(logits, md, torch.Generator().manual_seed(0)).sampled_token_ids.tolist()
        for r, t in zip(req_ids, tokens):
            self.batch.append_token(r, t)
            self.outputs[r].append(t)
        return md, tokens


GREEDY = SamplingParams(temperature=0.0)
MIXED = {
    "plain": GREEDY,
    "rep": SamplingParams(temperature=0.0, repetition_penalty=1.3),
    "rep-low": SamplingParams(temperature=0.0, repetition_penalty=0.7),
    "pres-freq": SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3),
    "neg": SamplingParams(temperature=0.0, presence_penalty=-1.5, frequency_penalty=-0.2),
    # The talker's rules: repetition penalty, then one suppressed id, sampled with top-k.
    "talker": SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, suppress_token_ids=[3]),
    "all": SamplingParams(
        temperature=0.0, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=1.1, suppress_token_ids=[9, 1]
    ),
    "allowed": SamplingParams(temperature=0.0, allowed_token_ids=[2, 4, 8, 16, 32], presence_penalty=2.0),
    "plain-sampled": SamplingParams(temperature=0.8, seed=3),
}


def _check_step(b: _Batch, logits: torch.Tensor, req_ids: list[str], md: SamplingMetadata, tokens: list[int]) -> None:
    shaped = _rules(logits, md)
    for i, r in enumerate(req_ids):
        ref = _reference(logits[i], b.prompts[r], b.outputs[r][:-1], b.batch.sampling_params[r])
        assert torch.equal(shaped[i], ref), r
        if b.batch.sampling_params[r].greedy:
            assert tokens[i] == int(ref.argmax()), r


def test_mixed_batch_matches_the_references_across_steps_moves_and_resume():
    gen = torch.Generator().manual_seed(0)
    b = _Batch()
    for i, (r, p) in enumerate(MIXED.items()):
        # Prompts repeat tokens, so repetition (prompt) and frequency (output only) differ.
        b.add(r, torch.randint(0, 12, (5 + i,), generator=gen).tolist(), p)
    for step in range(8):
        if step == 3:
            b.remove("rep")  # "plain-sampled" (the last row) moves into its row
        if step == 5:
            b.remove("all")  # preempted ...
        if step == 6:
            b.add("all", b.prompts["all"], MIXED["all"], b.outputs["all"])  # ... and resumed with its output
        req_ids = list(b.batch.req_ids)
        # Few distinct high logits: penalized tokens win or lose visibly.
        logits = torch.randn(len(req_ids), V, generator=gen) * 2
        logits[:, :12] += 3.0
        md, tokens = b.step(logits, req_ids)
        _check_step(b, logits, req_ids, md, tokens)
    # The penalties changed what was sampled (the test is not vacuous).
    assert any(b.outputs[r] != b.outputs["plain"] for r in ("pres-freq", "all"))
    assert all(t in MIXED["allowed"].allowed_token_ids for t in b.outputs["allowed"])
    assert 3 not in b.outputs["talker"]


def test_rows_without_rules_cost_nothing():
    b = _Batch()
    b.add("a", [1, 2, 3], GREEDY)
    b.add("b", [1, 2], SamplingParams(temperature=0.0, min_p=0.5))
    md, _ = b.step(torch.randn(2, V), ["a", "b"])
    assert md.plain_greedy and md.penalties is None and md.token_mask is None
    assert b.state.history.output_counts is None and b.state.token_mask is None  # nothing allocated
    # A penalized request in the batch that does not sample this step adds nothing to the step.
    b.add("c", [4, 4, 4], SamplingParams(temperature=0.0, repetition_penalty=2.0, suppress_token_ids=[0]))
    md, _ = b.step(torch.randn(2, V), ["a", "b"])
    assert md.plain_greedy
    # When it samples, only its row is penalized: the others are left bit-identical.
    logits = torch.randn(3, V)
    md, _ = b.step(logits, ["a", "c", "b"])
    assert not md.plain_greedy and md.penalties.index.tolist() == [1] and md.token_mask.index.tolist() == [1]
    shaped = _rules(logits, md)
    assert torch.equal(shaped[[0, 2]], logits[[0, 2]])
    assert not torch.equal(shaped[1], logits[1])


def test_penalties_leave_logprobs_raw():
    b = _Batch()
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=2.0, logprobs=2)
    b.add("a", [7, 7, 8], params)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = 10.0
    logits[0, 20] = 5.0
    rows = np.array([0])
    md = b.state.metadata(b.batch, rows, ["a"])
    out = Sampler()(logits, md)
    assert int(out.sampled_token_ids[0]) == 20  # 10 / 3 loses to 5 ...
    raw = torch.log_softmax(logits, -1)
    assert out.topk_token_ids[0, 0] == 7  # ... yet the reported distribution is the model's
    assert torch.allclose(out.sampled_logprobs, raw[0, out.sampled_token_ids])


@pytest.mark.parametrize("seed", range(4))
def test_token_history_follows_random_batch_traffic(seed):
    """Random adds, appends, removals (row moves) and resumes: the synced counts
    always equal a bincount of each row's output, the prompt mask its prompt."""
    rng = np.random.default_rng(seed)
    b = _Batch(max_num_reqs=6)
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    parked: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(60):
        op = rng.integers(4)
        if op == 0 and b.batch.num_reqs < 6:
            rid = f"r{next_id}"
            next_id += 1
            b.add(rid, rng.integers(0, V, rng.integers(1, 6)).tolist(), params)
        elif op == 1 and b.batch.num_reqs:
            rid = b.batch.req_ids[rng.integers(b.batch.num_reqs)]
            parked[rid] = b.outputs[rid]
            b.remove(rid)
        elif op == 2 and parked and b.batch.num_reqs < 6:
            rid = sorted(parked)[0]
            b.add(rid, b.prompts[rid], params, parked.pop(rid))
        elif b.batch.num_reqs:
            req_ids = [r for r in b.batch.req_ids if rng.random() < 0.7]  # some rows do not sample
            if req_ids:
                b.step(torch.randn(len(req_ids), V), req_ids)
                h = b.state.history
                for r in req_ids:
                    row = b.batch.req_id_to_index[r]
                    counts = np.bincount(b.outputs[r][:-1], minlength=V)  # before this step's token
                    assert (h.output_counts[row].numpy() == counts).all()
                    assert (h.prompt_mask[row].numpy() == (np.bincount(b.prompts[r], minlength=V) > 0)).all()


def test_history_sync_counts_several_new_tokens_at_once():
    h = TokenHistory(2, 8, torch.device("cpu"))
    h.reset_row(1)
    tokens = np.zeros((2, 10), dtype=np.int64)
    tokens[1, :7] = [1, 1, 2, 3, 3, 3, 7]
    h.sync(np.array([1]), tokens, np.array([0, 4]), np.array([0, 2]))
    assert h.output_counts[1].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    h.sync(np.array([1]), tokens, np.array([0, 7]), np.array([0, 2]))  # three tokens since
    assert h.output_counts[1].tolist() == [0, 0, 1, 3, 0, 0, 0, 1]
    assert h.prompt_mask[1].tolist() == [False, True] + [False] * 6


# -- limits: a value the state cannot hold is refused before anything changes ---


def _mutated(**changes) -> SamplingParams:
    """Params changed after construction (validation ran with the old values)."""
    params = SamplingParams(temperature=1.0)
    for k, v in changes.items():
        object.__setattr__(params, k, v)
    return params


@pytest.mark.parametrize(
    "field, value", [("top_k", 10**20), ("min_tokens", 10**20), ("seed", 2**64), ("temperature", float("nan"))]
)
def test_batch_and_state_refuse_values_past_their_arrays(field, value):
    b = _Batch()
    b.add("ok", [1, 2], GREEDY)
    bad = _mutated(**{field: value})
    with pytest.raises(ValueError, match=rf"'bad'.*SamplingParams\.{field} must be"):
        b.batch.add_request("bad", [1, 2], 2, 0, [], bad)
    assert b.batch.req_ids == ["ok"] and "bad" not in b.batch.generators  # the batch is unchanged
    before = (b.state.top_k.copy(), b.state.min_tokens.copy(), b.state.temperature.copy())
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        b.state.set_row(1, bad)
    assert all((x == y).all() for x, y in zip(before, (b.state.top_k, b.state.min_tokens, b.state.temperature)))


def test_allowed_ids_outside_the_vocabulary():
    params = SamplingParams(allowed_token_ids=[V, V + 1])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        params.check_vocab(V)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingState(2, V, [], torch.device("cpu")).set_row(0, params)
    # Suppressed and stop ids outside the vocabulary never match a logit: ignored.
    b = _Batch()
    b.add("a", [1], SamplingParams(temperature=0.0, suppress_token_ids=[V + 3]))
    assert b.state.masked[0] == False  # noqa: E712
    dataclasses.replace(params, allowed_token_ids=[1, V]).check_vocab(V + 1)


def test_verify_rows_read_the_drafts_before_their_position():
    """Speculative verification repeats a request's row once per draft position;
    position j's penalties and min_tokens count drafts[:j] as emitted, as if
    the drafts had been decoded one by one."""
    gen = torch.Generator().manual_seed(1)
    b = _Batch()
    params = {
        "rep": MIXED["rep"],
        "all": MIXED["all"],
        "plain": GREEDY,
        "min": SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], frequency_penalty=0.4),
    }
    for r, p in params.items():
        b.add(r, torch.randint(0, 12, (6,), generator=gen).tolist(), p, output=[4, 9] if r != "min" else [4])
    drafts = {"rep": [9, 9, 2], "all": [1, 3], "plain": [5], "min": [7, 8, 7]}
    req_ids, rows, drafted = [], [], []
    for r, d in drafts.items():
        for j in range(len(d) + 1):
            req_ids.append(r)
            rows.append(b.batch.req_id_to_index[r])
            drafted.append(d[:j])
    logits = torch.randn(len(req_ids), V, generator=gen) * 2
    logits[:, :12] += 3.0
    md = b.state.metadata(b.batch, np.array(rows), req_ids, drafted)
    shaped = _rules(logits, md)
    for i, r in enumerate(req_ids):
        ref = _reference(logits[i], b.prompts[r], b.outputs[r] + drafted[i], params[r])
        assert torch.equal(shaped[i], ref), (r, drafted[i])
    # min_tokens=3 with one output token: positions 0 and 1 (1 and 2 emitted) hold 7 and EOS back, 2 and 3 not.
    banned = set(zip(md.banned_rows.tolist(), md.banned_tokens.tolist()))
    first = req_ids.index("min")
    assert {(first, 7), (first, EOS), (first + 1, 7), (first + 1, EOS)} <= banned
    assert not {(first + 2, 7), (first + 3, 7)} & banned
    # The history itself is unchanged: each known token counted once (rows repeat in the step).
    again = b.state.metadata(b.batch, np.array([b.batch.req_id_to_index["rep"]]), ["rep"])
    ref = _reference(logits[0], b.prompts["rep"], b.outputs["rep"], params["rep"])
    assert torch.equal(_rules(logits[:1], again)[0], ref)


def test_a_tiny_repetition_penalty_keeps_the_logits_finite():
    """Dividing a seen token's logit by a penalty near float32's smallest would pass its range: the
    logit stops at the largest finite value, so the row's softmax stays a distribution."""
    logits = torch.tensor([[30.0, 1.0, -2.0]])
    seen = torch.tensor([[True, False, True]])
    out = apply_penalties(logits, torch.zeros(1, 3), seen, torch.tensor([1e-38]), None, None)
    assert torch.isfinite(out[0, :2]).all() and out[0, 0] == torch.finfo(torch.float32).max
    assert torch.softmax(out, dim=-1)[0, 0] == 1.0
