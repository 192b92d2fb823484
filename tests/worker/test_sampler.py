"""Sampler: greedy, filters, seeds, logprobs and min_tokens masking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.sampling_params import SamplingParams
from omnistage.worker.input_batch import InputBatch
from omnistage.testing.textbook_sampling import textbook_top_k_top_p
from omnistage.worker.sampler import Sampler, SamplingState, apply_top_k_top_p

V = 50
EOS = 7


def _metadata(params: list[SamplingParams], num_output: list[int] | None = None, order: list[int] | None = None):
    """Metadata for ``params`` placed in rows ``order`` (default 0..n-1) of a batch
    whose rows hold a 3-token prompt and ``num_output`` generated tokens."""
    order = order or list(range(len(params)))
    batch = InputBatch(max_num_reqs=16, max_model_len=64, block_size=4)
    state = SamplingState(max_num_reqs=16, vocab_size=V, eos_token_ids=[EOS], device=torch.device("cpu"))
    by_row = dict(zip(order, zip(params, num_output or [0] * len(params))))
    for row in range(max(order) + 1):  # fillers keep the batch dense up to the highest row
        p, n = by_row.get(row, (SamplingParams(), 0))
        assert batch.add_request(f"r{row}", [1, 2, 3] + [4] * n, 3, 0, [], p) == row
        state.set_row(row, p)
    return state.metadata(batch, np.array(order), [f"r{row}" for row in order])


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(4)
    md = _metadata([SamplingParams(temperature=0.0)] * 4)
    assert md.all_greedy and md.temperature is None
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_logprobs is None


def test_mixed_greedy_and_random_rows():
    logits = _logits(3)
    md = _metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)])
    out = Sampler()(logits, md, torch.Generator().manual_seed(0))
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[2] == logits[2].argmax()


def test_top_k_one_is_greedy_and_top_k_limits_support():
    logits = _logits(2)
    md = _metadata([SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=5.0, top_k=3)])
    top3 = set(logits[1].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        out = Sampler()(logits, md, gen)
        assert out.sampled_token_ids[0] == logits[0].argmax()
        assert int(out.sampled_token_ids[1]) in top3


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.7]))
    assert torch.isfinite(masked[0, :2]).all() and torch.isinf(masked[0, 2:]).all()
    # top_p = 1 (off) keeps everything; top-k and top-p compose.
    assert torch.isfinite(apply_top_k_top_p(logits, None, torch.tensor([1.0]))).all()
    both = apply_top_k_top_p(logits, torch.tensor([1]), torch.tensor([0.99]))
    assert torch.isfinite(both[0, 0]) and torch.isinf(both[0, 1:]).all()


def test_top_k_off_rows_keep_everything():
    logits = _logits(2)
    masked = apply_top_k_top_p(logits, torch.tensor([0, 2]), None)
    assert torch.isfinite(masked[0]).all()
    assert int(torch.isfinite(masked[1]).sum()) == 2


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.35, 0.05] + [1e-9] * (V - 3)]))
    md = _metadata([SamplingParams(temperature=1.0, min_p=0.5)])
    gen = torch.Generator().manual_seed(0)
    seen = {int(Sampler()(logits, md, gen).sampled_token_ids[0]) for _ in range(100)}
    assert seen == {0, 1}


def test_distribution_matches_softmax():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    state = SamplingState(4, 3, [], torch.device("cpu"))
    batch = InputBatch(4, 8, 4)
    batch.add_request("a", [0], 1, 0, [], SamplingParams(temperature=1.0))
    state.set_row(0, SamplingParams(temperature=1.0))
    md = state.metadata(batch, np.array([0]), ["a"])
    gen = torch.Generator().manual_seed(0)
    counts = np.bincount([int(Sampler()(logits, md, gen).sampled_token_ids[0]) for _ in range(3000)], minlength=3)
    assert np.allclose(counts / 3000, [0.7, 0.2, 0.1], atol=0.04)


def test_seeded_rows_do_not_depend_on_batch_composition():
    logits = _logits(4, seed=3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    # Alone in row 0.
    md = _metadata([seeded])
    alone = [int(Sampler()(logits[:1], md, torch.Generator().manual_seed(9)).sampled_token_ids[0]) for _ in range(10)]
    # Third row of a batch of four, with a differently seeded default generator.
    md = _metadata([other, other, seeded, other], order=[5, 2, 9, 0])
    batch_logits = torch.cat([logits[1:3], logits[:1], logits[3:]])
    mixed = [int(Sampler()(batch_logits, md, torch.Generator().manual_seed(i)).sampled_token_ids[2]) for i in range(10)]
    assert alone == mixed


def test_logprobs_are_raw_log_softmax():
    logits = _logits(2)
    md = _metadata([SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.5)])
    out = Sampler()(logits, md, torch.Generator().manual_seed(0))
    ref = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    assert torch.allclose(out.sampled_logprobs, ref.gather(1, sampled[:, None]).squeeze(1))
    assert out.topk_token_ids.shape == (2, 3)
    assert torch.equal(out.topk_token_ids[0], ref[0].topk(3).indices)
    assert torch.allclose(out.topk_logprobs[0], ref[0].topk(3).values)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, V)
    logits[:, EOS] = 10.0
    logits[:, 11] = 9.0
    logits[:, 12] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[11]),  # below min: EOS and 11 banned
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[11]),  # reached min: nothing banned
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),  # ignore_eos: EOS not a stop, not banned
    ]
    md = _metadata(params, num_output=[1, 2, 0])
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [12, EOS, EOS]


def test_out_of_vocab_stop_ids_are_ignored_by_the_mask():
    md = _metadata([SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[V + 5])])
    out = Sampler()(torch.zeros(1, V), md)
    assert md.banned_tokens.tolist() == [EOS]
    assert int(out.sampled_token_ids[0]) != EOS


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_half_precision_logits(temperature):
    logits = _logits(2).to(torch.bfloat16)
    md = _metadata([SamplingParams(temperature=temperature, top_p=0.9, logprobs=0)] * 2)
    out = Sampler()(logits, md, torch.Generator().manual_seed(0))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_logprobs.dtype == torch.float32 and out.topk_token_ids is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_argmax_equals_argmax_with_ties_and_nan(dtype):
    from omnistage.kernels.argmax import first_argmax

    torch.manual_seed(0)
    logits = torch.randint(-3, 4, (64, 1000)).to(dtype)  # many tied maxima per row
    logits[5, 17] = float("nan")
    logits[9, :] = float("-inf")
    logits[11, 999] = float("inf")
    assert torch.equal(first_argmax(logits), logits.argmax(-1))


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (a nucleus of thousands: the window widens) to peaked
def test_top_p_without_sorting_equals_the_sorted_definition(scale):
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(6, 5000, generator=gen) * scale
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.999, 1.0, 0.3])
    for top_k in (None, torch.tensor([0, 50, 2000, 1, 0, 4999])):
        ours = apply_top_k_top_p(logits, top_k, top_p)
        assert torch.equal(torch.isinf(ours), torch.isinf(textbook_top_k_top_p(logits, top_k, top_p)))
        assert torch.equal(ours[torch.isfinite(ours)], logits[torch.isfinite(ours)])


def test_a_draw_follows_the_weights_and_never_takes_a_zero_one():
    from omnistage.worker.sampler import draw_rows

    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(3)
    u = torch.rand(20000, dtype=torch.float64, generator=gen)
    ids = draw_rows(weights[:1].expand(20000, -1), u)
    counts = torch.bincount(ids, minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0 and abs(counts[1] / 20000 - 0.5) < 0.015
    assert abs(counts[3] / 20000 - 0.25) < 0.015
    edge = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)  # the ends of [0, 1)
    assert draw_rows(weights, edge).tolist() == [1, 0]
    assert draw_rows(weights[:1], torch.tensor([1.0], dtype=torch.float64)).tolist() == [4]  # u * total = total
    # A row without weight (NaN logits) still gets an id inside the vocabulary: the batch's next step runs.
    nan = torch.full((1, 6), float("nan"))
    assert 0 <= draw_rows(nan, torch.tensor([0.5], dtype=torch.float64)).item() < 6


def test_logit_bias_shifts_the_rows_that_carry_one():
    """Each row's biases are added to its own logits (rows moved and repeated, as a verify step's are),
    before temperature; logprobs stay the raw ones; a plain row is left alone."""
    logits = _logits(4, seed=5)
    biased = SamplingParams(temperature=0.5, logit_bias={3: 2.0, 40: -1.5})
    low = int(logits[2].argmin())  # the greedy row's least likely token
    greedy = SamplingParams(temperature=0.0, logit_bias={low: 100}, logprobs=1)
    md = _metadata([biased, SamplingParams(temperature=0.5), greedy], order=[4, 1, 2])
    assert not md.plain_greedy
    expected = logits[:3].clone()
    expected[0, 3] += 2.0
    expected[0, 40] -= 1.5
    expected[2, low] += 100
    shifted = Sampler.apply_logit_rules(logits[:3].clone(), md)
    assert torch.equal(shifted, expected)
    assert torch.allclose(Sampler.target_probs(shifted, md)[0], torch.softmax(expected[0] / 0.5, -1))
    out = Sampler()(logits[:3], md, torch.Generator().manual_seed(0))
    assert int(out.sampled_token_ids[2]) == low
    assert torch.allclose(out.sampled_logprobs[2], torch.log_softmax(logits[2], -1)[low])
    # A biased row repeated per draft position (speculative verification) is biased in every copy.
    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4)
    state = SamplingState(max_num_reqs=4, vocab_size=V, eos_token_ids=[EOS], device=torch.device("cpu"))
    batch.add_request("a", [1, 2, 3], 3, 0, [], biased)
    state.set_row(0, biased)
    md = state.metadata(batch, np.array([0, 0, 0]), ["a"] * 3, drafted=[[], [5], [5, 6]])
    assert md.bias_rows.tolist() == [0, 0, 1, 1, 2, 2]
    # A row that gets another request drops the bias.
    state.set_row(0, SamplingParams(temperature=0.5))
    assert state.metadata(batch, np.array([0]), ["a"]).bias_rows is None
