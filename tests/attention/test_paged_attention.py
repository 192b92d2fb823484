"""Paged attention against Hugging Face's own forward, on tiny real checkpoints.

Every scenario runs the real persistent batch (``InputBatch.prepare_step``)
over block ids drawn from a shuffled pool, and compares the logits of every
token it computes with HF's sdpa forward over that token's full sequence.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.models.loader import load_model
from omnistage.testing.tiny_checkpoints import TINY_ARCHS, write_tiny_checkpoint
from omnistage.sampling_params import SamplingParams
from omnistage.attention.paged_attention import (
    DECODE,
    MIXED,
    PREFILL,
    PREFILL_SINGLE,
    StepRows,
    allocate_kv_caches,
    build_attention_metadata,
    paged_attention_forward,
)
from omnistage.attention import kv_cache
from omnistage.attention import paged_attention as pa
from omnistage.worker.input_batch import InputBatch

BLOCK = 4
ATOL = 1e-4


class PagedHarness:
    """A minimal runner: an InputBatch, a shuffled block pool and the model's caches."""

    def __init__(self, lm, block_size: int = BLOCK, num_blocks: int = 96, seed: int = 0) -> None:
        self.lm = lm
        self.block_size = block_size
        self.caches = allocate_kv_caches(
            lm.num_layers, num_blocks, block_size, lm.num_kv_heads, lm.head_dim, lm.dtype, lm.device
        )
        self.batch = InputBatch(max_num_reqs=8, max_model_len=128, block_size=block_size, device=lm.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, unordered block ids
        self.blocks: dict[str, list[int]] = {}
        self.kinds: list[str] = []

    def add(self, req_id: str, tokens: list[int], shared_blocks: list[int] = (), num_computed: int = 0) -> None:
        need = -(-len(tokens) // self.block_size) - len(shared_blocks)
        blocks = list(shared_blocks) + [self.free.pop() for _ in range(need)]
        self.blocks[req_id] = blocks
        self.batch.add_request(req_id, tokens, len(tokens), num_computed, blocks, SamplingParams())

    def step(self, sched: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run one step; returns the fp32 logits of each request's scheduled tokens."""
        step = self.batch.prepare_step(sched)
        md = build_attention_metadata(step, self.block_size)
        self.kinds.append(md.kind)
        hidden = self.lm.forward(step.input_ids, step.positions, md, self.caches)
        logits = self.lm.compute_logits(hidden)
        out = {}
        for i, req_id in enumerate(step.req_ids):
            a, b = int(step.query_start_loc[i]), int(step.query_start_loc[i + 1])
            out[req_id] = logits[a:b].cpu()
            self.batch.update_request(req_id, [], int(step.seq_lens[i]))
        return out


@pytest.fixture(scope="module", params=[(a, p) for a in TINY_ARCHS for p in ("lean", "hf")], ids=lambda x: "-".join(x))
def models(request, tmp_path_factory):
    """Our model on the lean forward or on HF's modules with the paged attention function."""
    arch, path_kind = request.param
    path = write_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))
    ours = load_model(str(path)).model
    assert ours.lean is not None
    ours.use_lean = path_kind == "lean"
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return ours, ref


def reference_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def prompts(n: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, n, size=length).tolist() for length in lengths]


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_packed_prefill_of_several_prompts(models):
    ours, ref = models
    seqs = prompts(ours.vocab_size, [5, 11, 3, 17])
    h = PagedHarness(ours)
    for i, s in enumerate(seqs):
        h.add(f"r{i}", s)
    out = h.step({f"r{i}": len(s) for i, s in enumerate(seqs)})
    assert h.kinds == [PREFILL]
    for i, s in enumerate(seqs):
        check(out[f"r{i}"], reference_logits(ref, s))


@pytest.mark.parametrize("lengths", [[9], [6, 6, 6]], ids=["single", "equal-lengths"])
def test_prefill_fast_paths(models, lengths):
    ours, ref = models
    seqs = prompts(ours.vocab_size, lengths, seed=2)
    h = PagedHarness(ours)
    for i, s in enumerate(seqs):
        h.add(f"r{i}", s)
    out = h.step({f"r{i}": len(s) for i, s in enumerate(seqs)})
    assert h.kinds == [PREFILL_SINGLE if len(seqs) == 1 else PREFILL]
    for i, s in enumerate(seqs):
        check(out[f"r{i}"], reference_logits(ref, s))


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_across_steps(models, chunk):
    ours, ref = models
    seqs = prompts(ours.vocab_size, [13, 4, 22], seed=3)
    h = PagedHarness(ours, seed=chunk)
    for i, s in enumerate(seqs):
        h.add(f"r{i}", s)
    done = [0] * len(seqs)
    got: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(seqs))}
    while any(d < len(s) for d, s in zip(done, seqs)):
        sched = {f"r{i}": min(chunk, len(s) - done[i]) for i, s in enumerate(seqs) if done[i] < len(s)}
        for req_id, logits in h.step(sched).items():
            got[req_id].append(logits)
            done[int(req_id[1:])] += sched[req_id]
    assert MIXED in h.kinds or DECODE in h.kinds
    for i, s in enumerate(seqs):
        check(torch.cat(got[f"r{i}"]), reference_logits(ref, s))


def test_decode_steps_for_sequences_of_different_lengths(models):
    ours, ref = models
    prompt_lens = [3, 10, 6]
    seqs = prompts(ours.vocab_size, [n + 6 for n in prompt_lens], seed=4)  # prompt + 6 "generated" tokens
    h = PagedHarness(ours, seed=5)
    for i, s in enumerate(seqs):
        h.add(f"r{i}", s)
    h.step({f"r{i}": n for i, n in enumerate(prompt_lens)})
    for t in range(6):
        out = h.step({f"r{i}": 1 for i in range(len(seqs))})
        for i, s in enumerate(seqs):
            pos = prompt_lens[i] + t
            check(out[f"r{i}"][0], reference_logits(ref, s[: pos + 1])[pos])
    assert h.kinds[1:] == [DECODE] * 6


def test_single_sequence_decode(models):
    ours, ref = models
    (seq,) = prompts(ours.vocab_size, [12], seed=6)
    h = PagedHarness(ours, seed=6)
    h.add("r0", seq)
    h.step({"r0": 8})
    want = reference_logits(ref, seq)
    for pos in range(8, 12):
        check(h.step({"r0": 1})["r0"][0], want[pos])
    assert h.kinds[1:] == [DECODE] * 4


def test_mixed_step_with_decode_and_prefill(models):
    ours, ref = models
    a, b = prompts(ours.vocab_size, [9, 7], seed=7)
    h = PagedHarness(ours, seed=7)
    h.add("a", a)
    h.step({"a": 8})
    h.add("b", b)
    out = h.step({"a": 1, "b": 7})
    assert h.kinds[-1] == MIXED
    check(out["a"][0], reference_logits(ref, a)[8])
    check(out["b"], reference_logits(ref, b))


def test_prefix_hit_reads_blocks_written_by_another_sequence(models):
    ours, ref = models
    (shared,) = prompts(ours.vocab_size, [3 * BLOCK], seed=8)
    a = shared + [5, 6, 7]
    b = shared + [9, 10, 11, 12, 13]
    h = PagedHarness(ours, seed=8)
    h.add("a", a)
    h.step({"a": len(a)})
    prefix_blocks = h.blocks["a"][:3]
    h.batch.remove_request("a")  # the blocks stay in the cache, as after a finished request
    h.add("b", b, shared_blocks=prefix_blocks, num_computed=3 * BLOCK)
    out = h.step({"b": len(b) - 3 * BLOCK})
    assert h.kinds[-1] == MIXED
    check(out["b"], reference_logits(ref, b)[3 * BLOCK :])


def test_slot_minus_one_is_not_written(models):
    ours, ref = models
    (seq,) = prompts(ours.vocab_size, [6], seed=9)
    h = PagedHarness(ours, seed=9)
    h.add("r0", seq)
    step = h.batch.prepare_step({"r0": 6})
    skipped = int(step.slot_mapping[-1])
    step.slot_mapping = step.slot_mapping.clone()
    step.slot_mapping[-1] = -1
    md = build_attention_metadata(step, BLOCK)
    logits = ours.compute_logits(ours.forward(step.input_ids, step.positions, md, h.caches))
    check(logits, reference_logits(ref, seq))
    keys = h.caches[0][0].view(ours.num_kv_heads, -1, ours.head_dim)  # [Hkv, slots, D]
    assert torch.count_nonzero(keys[:, skipped]) == 0
    assert torch.count_nonzero(keys[:, int(step.slot_mapping[0])]) > 0


def test_attention_outside_context_raises(models):
    ours, _ = models
    attn = ours.hf_model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 1, ours.head_dim)
    kv = torch.zeros(1, ours.num_kv_heads, 1, ours.head_dim)
    with pytest.raises(RuntimeError, match="attention_context"):
        paged_attention_forward(attn, q, kv, kv, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_chunk_and_decode_on_cuda(tmp_path):
    path = write_tiny_checkpoint("qwen3", tmp_path / "q3")
    ours = load_model(str(path), device="cuda").model
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    a, b = prompts(ours.vocab_size, [14, 6], seed=10)
    h = PagedHarness(ours, seed=10)
    h.add("a", a)
    h.add("b", b)
    first = h.step({"a": 7, "b": 5})
    second = h.step({"a": 6, "b": 1})
    third = h.step({"a": 1})
    assert h.kinds == [PREFILL, MIXED, DECODE]
    check(torch.cat([first["a"], second["a"], third["a"]]), reference_logits(ref, a))
    check(torch.cat([first["b"], second["b"]]), reference_logits(ref, b))


def test_inputs_embeds_equal_input_ids(models):
    ours, _ = models
    (seq,) = prompts(ours.vocab_size, [7], seed=11)
    outs = []
    for use_embeds in (False, True):
        h = PagedHarness(ours, seed=11)
        h.add("r0", seq)
        step = h.batch.prepare_step({"r0": 7})
        md = build_attention_metadata(step, BLOCK)
        embeds = ours.embed_input_ids(step.input_ids) if use_embeds else None
        outs.append(ours.forward(step.input_ids, step.positions, md, h.caches, inputs_embeds=embeds))
    assert outs[0].shape == (7, ours.hidden_size)
    torch.testing.assert_close(outs[0], outs[1])


def decode_and_check(h: PagedHarness, ref, seqs: dict[str, list[int]], done: dict[str, int], steps: int) -> None:
    """``steps`` decode steps of every request in ``done`` (tokens computed so far), each checked."""
    for _ in range(steps):
        out = h.step({r: 1 for r in done})
        for r in done:
            pos = done[r]
            check(out[r][0], reference_logits(ref, seqs[r][: pos + 1])[pos])
            done[r] += 1


def test_dense_decode_view_is_built_reused_and_grown(models, monkeypatch):
    """Decode steps of an unchanged batch read a contiguous per-layer view; with a margin of one
    key it is rebuilt (grown) every few steps."""
    ours, ref = models
    monkeypatch.setattr(kv_cache, "DENSE_DECODE_MARGIN", 1)
    lens = [3, 9, 5]
    seqs = {f"r{i}": s for i, s in enumerate(prompts(ours.vocab_size, [n + 8 for n in lens], seed=12))}
    h = PagedHarness(ours, seed=12)
    for r, s in seqs.items():
        h.add(r, s)
    h.step({f"r{i}": n for i, n in enumerate(lens)})
    view = kv_cache.dense_view(h.caches[0])
    assert not view.valid
    done = {f"r{i}": n for i, n in enumerate(lens)}
    decode_and_check(h, ref, seqs, done, 1)
    assert not view.valid  # the first decode step of a batch only records it
    capacities = set()
    for _ in range(7):
        decode_and_check(h, ref, seqs, done, 1)
        assert view.valid and view.keys.shape[1] == 3
        capacities.add(view.keys.shape[2])
    assert len(capacities) > 1


def test_dense_decode_view_follows_batch_changes(models):
    """A request leaving (its row refilled by the last one) or joining, or a request id coming
    back with other tokens, never lets a stale view be read."""
    ours, ref = models
    seqs = {f"r{i}": s for i, s in enumerate(prompts(ours.vocab_size, [16, 14, 16], seed=13))}
    h = PagedHarness(ours, seed=13)
    for r in ("r0", "r1", "r2"):
        h.add(r, seqs[r])
    h.step({"r0": 6, "r1": 5, "r2": 4})
    done = {"r0": 6, "r1": 5, "r2": 4}
    decode_and_check(h, ref, seqs, done, 3)
    assert kv_cache.dense_view(h.caches[0]).valid
    h.batch.remove_request("r0")  # r2 moves into row 0
    del done["r0"]
    decode_and_check(h, ref, seqs, done, 3)
    # r0 comes back under the same id with a different prompt of the same length.
    seqs["r0"] = prompts(ours.vocab_size, [16], seed=14)[0]
    h.add("r0", seqs["r0"])
    out = h.step({"r1": 1, "r2": 1, "r0": done["r1"] + 1})
    check(out["r0"], reference_logits(ref, seqs["r0"])[: done["r1"] + 1])
    for r in ("r1", "r2"):
        check(out[r][0], reference_logits(ref, seqs[r][: done[r] + 1])[done[r]])
        done[r] += 1
    done["r0"] = done["r1"]
    decode_and_check(h, ref, seqs, done, 2)


def test_dense_decode_view_respects_the_byte_budget(models, monkeypatch):
    ours, ref = models
    monkeypatch.setenv(kv_cache.DENSE_DECODE_ENV, "0")
    seqs = {f"r{i}": s for i, s in enumerate(prompts(ours.vocab_size, [10, 7], seed=15))}
    h = PagedHarness(ours, seed=15)
    for r, s in seqs.items():
        h.add(r, s)
    h.step({"r0": 5, "r1": 3})
    done = {"r0": 5, "r1": 3}
    decode_and_check(h, ref, seqs, done, 4)
    view = kv_cache.dense_view(h.caches[0])
    assert view.keys is None and not view.valid


def test_dense_decode_view_when_the_scheduled_subset_changes(models):
    """Two decode steps of {r0, r1}, then of {r1, r2}: same batch size, other requests."""
    ours, ref = models
    seqs = {f"r{i}": s for i, s in enumerate(prompts(ours.vocab_size, [14, 12, 10], seed=16))}
    h = PagedHarness(ours, seed=16)
    for r, s in seqs.items():
        h.add(r, s)
    h.step({"r0": 5, "r1": 4, "r2": 3})
    decode_and_check(h, ref, seqs, {"r0": 5, "r1": 4}, 3)
    decode_and_check(h, ref, seqs, {"r1": 7, "r2": 3}, 3)
    decode_and_check(h, ref, seqs, {"r0": 8, "r2": 6}, 2)


def test_verify_steps_continue_the_dense_view_through_rejected_drafts(models, monkeypatch):
    """Steps of a few tokens per row (speculative verify) append to the dense views; a row rolled
    back past rejected drafts (other tokens at those positions next step) still reads the view,
    and every token's logits equal HF's over the tokens the batch holds then."""
    ours, ref = models
    gathers = []
    gather = pa.gather_kv
    monkeypatch.setattr(pa, "gather_kv", lambda *a: gathers.append(1) or gather(*a))
    seqs = {f"r{i}": s for i, s in enumerate(prompts(ours.vocab_size, [40, 40], seed=17))}
    h = PagedHarness(ours, seed=17)
    for r, s in seqs.items():
        h.add(r, s)
    row = {r: h.batch.req_id_to_index[r] for r in seqs}

    def step_and_check(sched: dict[str, int]) -> None:
        start = {r: int(h.batch.num_computed_tokens_cpu[row[r]]) for r in sched}
        out = h.step(sched)
        for r, n in sched.items():
            held = h.batch.token_ids_cpu[row[r], : start[r] + n].tolist()
            check(out[r], reference_logits(ref, held)[start[r] :])

    step_and_check({"r0": 10, "r1": 8})
    step_and_check({"r0": 1, "r1": 1})
    step_and_check({"r0": 1, "r1": 1})  # builds the views
    view = kv_cache.dense_view(h.caches[0])
    assert view.valid
    gathers.clear()
    for drafts, accepted in (((3, 1), (1, 0)), ((2, 4), (2, 0)), ((0, 2), (0, 2))):
        # Drafts the target will reject after the first `accepted`: other tokens than the sequence's.
        start = {r: int(h.batch.num_computed_tokens_cpu[row[r]]) for r in seqs}
        for (r, k), a in zip(zip(seqs, drafts), accepted):
            for j in range(a + 1, k + 1):
                h.batch.token_ids_cpu[row[r], start[r] + j] = (seqs[r][start[r] + j] + 1) % ours.vocab_size
        step_and_check({r: 1 + k for r, k in zip(seqs, drafts)})
        for (r, k), a in zip(zip(seqs, drafts), accepted):  # roll back: the bonus token replaces the first rejected
            h.batch.token_ids_cpu[row[r], start[r] : start[r] + k + 1] = torch.tensor(seqs[r][start[r] : start[r] + k + 1])
            h.batch.update_request(r, [], start[r] + a + 1)
        assert view.valid
    step_and_check({"r0": 1, "r1": 1})
    assert gathers == []  # every step read the views


def test_step_rows_follow_a_step_they_continue():
    prev = StepRows(("a", "b"), (10, 20), (13, 21))
    assert StepRows(("a", "b"), (13, 21), (14, 22)).follows(prev)  # all drafts kept / plain decode
    assert StepRows(("a", "b"), (11, 21), (15, 22)).follows(prev)  # a's drafts rejected after one
    assert not StepRows(("a", "b"), (10, 21), (11, 22)).follows(prev)  # a did not advance: recomputed
    assert not StepRows(("a", "b"), (14, 21), (15, 22)).follows(prev)  # a skipped a token
    assert not StepRows(("b", "a"), (21, 13), (22, 14)).follows(prev)  # other rows
    assert not StepRows(("a", "b"), (13, 21), (14, 22)).follows(None)


def test_a_step_of_some_of_the_previous_rows_continues_in_their_rows():
    prev = StepRows(("a", "b", "c"), (10, 20, 30), (11, 21, 31))
    step = StepRows(("c", "a"), (31, 11), (32, 12))  # b left; the others advanced
    assert step.rows_in(prev).tolist() == [2, 0] and not step.follows(prev)
    after = prev.advanced(step.rows_in(prev), step)
    assert after == StepRows(("a", "b", "c"), (11, 20, 31), (12, 21, 32))  # b's row as it was
    assert StepRows(("a",), (12,), (13,)).rows_in(after).tolist() == [0]
    assert StepRows(("a", "d"), (11, 5), (12, 6)).rows_in(prev) is None  # d has no row
    assert StepRows(("a",), (10,), (11,)).rows_in(prev) is None  # a did not advance
    assert StepRows(("a",), (12,), (13,)).rows_in(prev) is None  # a skipped a token: its row lacks it

