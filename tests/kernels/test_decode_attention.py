"""The native decode-attention kernel against fp64 softmax attention, per sequence."""

from __future__ import annotations

import pytest
import torch

from omnistage.kernels.attention import native_decode_attention
from omnistage.kernels.native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels need x86-64 AVX2 and g++")


def reference(query, keys, values, seq_lens, scale):
    """fp64 attention of each sequence's query heads over its first ``seq_lens[r]`` keys."""
    heads, seqs, dim = query.shape
    group = heads // keys.shape[0]
    out = torch.empty(seqs, heads, dim, dtype=torch.float64)
    for r in range(seqs):
        n = int(seq_lens[r])
        for h in range(heads):
            k, v = keys[h // group, r, :n].double(), values[h // group, r, :n].double()
            out[r, h] = torch.softmax(k @ query[h, r].double() * scale, 0) @ v
    return out


@pytest.mark.parametrize("dim", [32, 64, 128])
# Groups of 1, 3, 5, 6 and 7 query heads per KV head: the kernel takes heads four (two at dim 128) at a time.
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (10, 2), (12, 2), (14, 2)])
def test_matches_fp64_attention_over_each_sequence_length(dim, heads, kv_heads):
    gen = torch.Generator().manual_seed(dim + heads)
    seqs, capacity = 5, 80
    # q as the lean forward hands it over: a [H, R, D] view of the packed [R, H + 2 Hkv, D] projections.
    query = torch.randn(seqs, heads + 2 * kv_heads, dim, generator=gen)[:, :heads].transpose(0, 1)
    # keys/values as a slice of a longer dense view, with garbage past each sequence's length.
    dense = torch.randn(2, kv_heads, seqs, capacity, dim, generator=gen) * 3
    keys, values = dense[0, :, :, :70], dense[1, :, :, :70]
    seq_lens = torch.tensor([1, 15, 16, 17, 70])
    got = native_decode_attention(query, keys, values, seq_lens, dim**-0.5)
    want = reference(query, keys, values, seq_lens, dim**-0.5)
    assert got is not None and got.shape == (seqs, heads, dim)
    # fp32 attention through torch's own ops, for the size of an fp32 rounding difference.
    torch_err = max(
        (
            torch.softmax(keys[h * kv_heads // heads, r, :n] @ query[h, r] * dim**-0.5, 0)
            @ values[h * kv_heads // heads, r, :n]
            - want[r, h]
        )
        .abs()
        .max()
        for r, n in enumerate(seq_lens.tolist())
        for h in range(heads)
    )
    assert (got.double() - want).abs().max() <= 4 * torch_err + 1e-6


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_query_heads_sharing_a_kv_head_get_the_bits_they_would_alone(dim):
    # Heads that share a KV head are computed together, reading each key once: each must come out
    # bit for bit as with a KV head of its own (keys past a multiple of 16 summed one by one).
    gen = torch.Generator().manual_seed(dim)
    heads, kv_heads, seqs = 7, 1, 3
    query = torch.randn(heads, seqs, dim, generator=gen)
    keys, values = torch.randn(2, kv_heads, seqs, 50, dim, generator=gen)
    seq_lens = torch.tensor([5, 32, 50])
    shared = native_decode_attention(query, keys, values, seq_lens, dim**-0.5)
    own = native_decode_attention(
        query, keys.expand(heads, -1, -1, -1).contiguous(), values.expand(heads, -1, -1, -1).contiguous(),
        seq_lens, dim**-0.5,
    )
    assert shared is not None and torch.equal(shared, own)


def test_large_scores_do_not_overflow():
    # Scores in the thousands: exp must see them minus their maximum (softmax saturates to one key).
    gen = torch.Generator().manual_seed(0)
    query = torch.full((2, 1, 64), 30.0)
    keys = torch.randn(1, 1, 40, 64, generator=gen) * 30
    values = torch.randn(1, 1, 40, 64, generator=gen)
    got = native_decode_attention(query, keys, values, torch.tensor([40]), 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, values[0, 0, (keys[0, 0] @ query[0, 0]).argmax()].expand(1, 2, 64))


def test_declines_what_it_does_not_cover():
    q, kv, lens = torch.randn(2, 3, 48), torch.randn(1, 3, 8, 48), torch.tensor([8, 8, 8])
    assert native_decode_attention(q, kv, kv, lens, 1.0) is None  # head size 48
    q, kv = torch.randn(2, 3, 64), torch.randn(1, 3, 8, 64)
    assert native_decode_attention(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), lens, 1.0) is None
    assert native_decode_attention(q, kv, kv, lens.int(), 1.0) is None
    assert native_decode_attention(q, kv, kv.transpose(2, 3), lens, 1.0) is None  # columns, not rows


def test_tokens_of_a_verify_step_read_their_own_row_up_to_their_position():
    # Three sequences with 1, 3 and 2 query tokens (a decode row and two verify runs), each token
    # over its sequence's keys up to its own position: the same numbers, bit for bit, as the
    # one-token call for that row and length (a token's result depends on nothing else in its step).
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, seqs = 6, 2, 64, 3
    dense = torch.randn(2, kv_heads, seqs, 48, dim, generator=gen)
    keys, values = dense[0], dense[1]
    rows = torch.tensor([0, 1, 1, 1, 2, 2])
    lens = torch.tensor([20, 30, 31, 32, 9, 10])
    query = torch.randn(heads, len(rows), dim, generator=gen)
    got = native_decode_attention(query, keys, values, lens, dim**-0.5, rows)
    assert got is not None and got.shape == (len(rows), heads, dim)
    for t, (r, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        alone = native_decode_attention(
            query[:, t : t + 1], keys[:, r : r + 1], values[:, r : r + 1], torch.tensor([n]), dim**-0.5
        )
        assert torch.equal(got[t], alone[0])
        want = reference(query[:, t : t + 1], keys[:, r : r + 1], values[:, r : r + 1], [n], dim**-0.5)
        assert (got[t].double() - want[0]).abs().max() < 1e-5
