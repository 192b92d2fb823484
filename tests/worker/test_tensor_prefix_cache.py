"""OmniTensorPrefixCache beyond the seed: row validity, allocated-only deferred
commits, N-D per-token tensors, typed errors, 0-d passthrough, padding slots,
copy-free misses, and a round trip through the real InputBatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.worker.tensor_prefix_cache import OmniTensorPrefixCache

NUM_BLOCKS = 10
BLOCK = 4
HIDDEN = 4  # 16-byte fp32 rows: writes take the wide (16-byte element) path; width 5 keys do not


class FakeBlockTable:
    """The block-table surface the cache reads: ``block_tables`` and ``[0]``."""

    def __init__(self, rows: list[list[int]], allocated: list[int] | None) -> None:
        group = type("Group", (), {})()
        group.block_table = type("Buf", (), {})()
        group.block_table.cpu = torch.tensor(rows, dtype=torch.int32)
        if allocated is not None:
            group.num_blocks_per_row = np.array(allocated, dtype=np.int32)
        self.block_tables = [group]

    def __getitem__(self, idx: int):
        return self.block_tables[idx]


class FakeBatch:
    def __init__(self, rows, num_computed, allocated=None, req_ids=("req1", "req2")) -> None:
        self.req_ids = list(req_ids)
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}
        self.num_computed_tokens_cpu = np.array(num_computed, dtype=np.int64)
        self.block_table = FakeBlockTable(rows, allocated)


def make_cache(dtype: torch.dtype = torch.float32, hidden: int = HIDDEN) -> OmniTensorPrefixCache:
    return OmniTensorPrefixCache(num_blocks=NUM_BLOCKS, block_size=BLOCK, hidden_size=hidden, hs_dtype=dtype)


def write_hidden(cache, slots, rows=None):
    rows = torch.rand(len(slots), HIDDEN) if rows is None else rows
    cache.update_omni_tensor_prefix_cache(rows, None, len(slots), torch.tensor(slots))
    return rows


def merge_hidden(cache, batch, new, lengths):
    qsl = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return cache.get_merged_hidden_states(qsl, batch, new, dict(zip(batch.req_ids, lengths)))


# req1 hits blocks 2 and 3 (8 computed tokens); req2 is a miss.
HIT_BATCH = dict(rows=[[2, 3, 4, 0], [6, 7, 0, 0]], num_computed=[8, 0], allocated=[3, 2])


# ---- 1. validity ------------------------------------------------------------------------


def test_hit_on_never_written_rows_raises_naming_request_and_key():
    cache = make_cache()
    cache.add_prefix_cached_new_req_id("req1")
    with pytest.raises(RuntimeError, match=r"'req1'.*'hidden_states'"):
        merge_hidden(cache, FakeBatch(**HIT_BATCH), torch.rand(5, HIDDEN), [3, 2])


def test_hit_on_partly_written_blocks_raises_naming_the_block():
    cache = make_cache()
    write_hidden(cache, list(range(8, 12)) + [12, 13, 14])  # block 3 misses its last row
    cache.add_prefix_cached_new_req_id("req1")
    with pytest.raises(RuntimeError, match=r"req1.*blocks \[3\]"):
        merge_hidden(cache, FakeBatch(**HIT_BATCH), torch.rand(5, HIDDEN), [3, 2])


def test_invalidated_blocks_are_not_served_until_rewritten():
    cache = make_cache()
    write_hidden(cache, list(range(8, 16)))
    cache.invalidate_blocks([3])
    cache.add_prefix_cached_new_req_id("req1")
    batch = FakeBatch(**HIT_BATCH)
    with pytest.raises(RuntimeError, match="req1"):
        merge_hidden(cache, batch, torch.rand(5, HIDDEN), [3, 2])

    fresh = write_hidden(cache, list(range(8, 16)))
    new = torch.rand(5, HIDDEN)
    merged = merge_hidden(cache, batch, new, [3, 2])
    assert torch.equal(merged["req1"], torch.cat([fresh, new[:3]]))
    assert torch.equal(merged["req2"], new[3:])


def test_validity_is_tracked_per_key():
    cache = make_cache()
    write_hidden(cache, list(range(8, 16)))
    # "foo" is registered only now: blocks 2, 3 hold hidden rows but no "foo" rows.
    cache.update_omni_tensor_prefix_cache(None, {"foo": torch.rand(4, 5)}, 4, torch.arange(24, 28))
    cache.add_prefix_cached_new_req_id("req1")
    batch = FakeBatch(**HIT_BATCH)
    merged = merge_hidden(cache, batch, torch.rand(5, HIDDEN), [3, 2])
    assert merged["req1"].shape == (11, HIDDEN)
    with pytest.raises(RuntimeError, match=r"'req1'.*'foo'"):
        cache.get_merged_multimodal_states([0, 3], batch, {"foo": torch.rand(5, 5)}, {"req1": 3, "req2": 2})


def test_invalidate_hits_every_key_and_only_the_given_blocks():
    cache = make_cache()
    cache.update_omni_tensor_prefix_cache(
        torch.rand(8, HIDDEN), {"foo": torch.rand(8, 5)}, 8, torch.arange(8, 16)
    )
    cache.invalidate_blocks(torch.tensor([2]))
    assert not cache._hidden.valid[2].any() and cache._hidden.valid[3].all()
    assert not cache._mm["foo"].valid[2].any() and cache._mm["foo"].valid[3].all()
    cache.invalidate_blocks(np.array([3], dtype=np.int32))
    assert not cache._mm["foo"].valid[3].any()
    cache.invalidate_blocks([])  # no-op


def test_invalidate_rejects_out_of_range_blocks():
    cache = make_cache()
    with pytest.raises(ValueError, match=r"\[0, 10\).*got 10"):
        cache.invalidate_blocks([10])
    with pytest.raises(ValueError):
        cache.invalidate_blocks([-1])


def test_deferred_commit_marks_rows_valid_and_invalidation_clears_them():
    cache = make_cache()
    batch = FakeBatch(rows=[[2, 3, 0, 0], [6, 7, 0, 0]], num_computed=[8, 0], allocated=[2, 2])
    codes = torch.arange(16).reshape(8, 2)
    cache.stage_deferred_mm_outputs([0, 8], batch, {"codes": codes}, {"req1": 8, "req2": 0}, {"codes"})
    cache.commit_deferred_mm_outputs({"req1"}, batch)
    cache.add_prefix_cached_new_req_id("req1")
    args = ([0, 1], batch, {"codes": torch.tensor([[7, 7]])}, {"req1": 1, "req2": 0})
    assert torch.equal(cache.get_merged_multimodal_states(*args)["codes"]["req1"][:8], codes)
    cache.invalidate_blocks([3])
    with pytest.raises(RuntimeError, match=r"'req1'.*'codes'"):
        cache.get_merged_multimodal_states(*args)


# ---- 2. deferred commits stay inside allocated blocks -----------------------------------------


def test_deferred_commit_drops_positions_past_allocated_blocks():
    cache = make_cache()
    # Row 0 owns only block 2; entries 1.. of the row are unallocated (0 here, as a fresh table).
    batch = FakeBatch(rows=[[2, 0, 0, 0], [6, 7, 0, 0]], num_computed=[8, 0], allocated=[1, 2])
    codes = torch.arange(1, 17).reshape(8, 2)
    cache.stage_deferred_mm_outputs([0, 8], batch, {"codes": codes}, {"req1": 8, "req2": 0}, {"codes"})
    cache.commit_deferred_mm_outputs({"req1"}, batch)
    rows = cache.mm_outputs_cache["codes"].view(-1, 2)
    assert torch.equal(rows[8:12], codes[:4])
    assert torch.count_nonzero(rows[:8]) == 0  # block 0 (and 1) untouched
    assert torch.count_nonzero(rows[12:]) == 0
    assert cache._mm["codes"].valid.sum() == 4


def test_deferred_commit_into_real_input_batch_respects_num_blocks_per_row():
    from omnistage.sampling_params import SamplingParams
    from omnistage.worker.input_batch import InputBatch

    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=BLOCK)
    batch.add_request("a", list(range(8)), 8, 6, [5], SamplingParams())  # 6 computed, one block
    cache = make_cache()
    codes = torch.arange(1, 13).reshape(6, 2)
    cache.stage_deferred_mm_outputs(np.array([0, 6]), batch, {"codes": codes}, {"a": 6}, {"codes"})
    cache.commit_deferred_mm_outputs(["a"], batch)
    rows = cache.mm_outputs_cache["codes"].view(-1, 2)
    assert torch.equal(rows[20:24], codes[:4])
    assert torch.count_nonzero(rows) == 8  # positions 4, 5 had no block: dropped, not sent to block 0


def test_a_bad_deferred_key_does_not_cost_other_requests_their_rows():
    cache = make_cache()
    cache.maybe_init_missing_mm_cache_keys({"codes": torch.zeros(4, 2, dtype=torch.long)}, 4)
    batch = FakeBatch(rows=[[2, 0], [6, 0]], num_computed=[4, 4], allocated=[1, 1])
    good, bad = torch.arange(8).reshape(4, 2), torch.zeros(4, 2, dtype=torch.int32)
    sched = {"req1": 4, "req2": 4}
    cache.stage_deferred_mm_outputs([0, 4], batch, {"codes": torch.cat([bad.long(), good])}, sched, {"codes"})
    cache._deferred_mm_outputs["req1"]["codes"][0] = (0, bad)  # req1 staged rows of the wrong dtype
    with pytest.raises(ValueError, match=r"'codes'.*torch\.int64.*torch\.int32"):
        cache.commit_deferred_mm_outputs(["req1", "req2"], batch)
    rows = cache.mm_outputs_cache["codes"].view(-1, 2)
    assert torch.equal(rows[24:28], good) and torch.count_nonzero(rows[8:12]) == 0
    assert not cache._deferred_mm_outputs


def test_overlapping_deferred_chunks_keep_the_latest():
    cache = make_cache()
    batch = FakeBatch(rows=[[2, 3, 0, 0], [6, 7, 0, 0]], num_computed=[4, 0], allocated=[2, 2])
    old, new = torch.full((4, 2), 1), torch.full((4, 2), 2)
    for chunk in (old, new):  # both staged as positions 0..3
        cache.stage_deferred_mm_outputs([0, 4], batch, {"codes": chunk}, {"req1": 4, "req2": 0}, {"codes"})
    cache.commit_deferred_mm_outputs({"req1"}, batch)
    assert torch.equal(cache.mm_outputs_cache["codes"].view(-1, 2)[8:12], new)


def test_staged_chunks_are_copies_of_the_step_output():
    cache = make_cache()
    batch = FakeBatch(rows=[[2, 3, 0, 0], [6, 7, 0, 0]], num_computed=[4, 0], allocated=[2, 2])
    out = torch.arange(8).reshape(4, 2)
    cache.stage_deferred_mm_outputs([0, 4], batch, {"codes": out}, {"req1": 4, "req2": 0}, {"codes"})
    expected = out.clone()
    out.fill_(-5)  # the runner reuses its output buffer next step
    cache.commit_deferred_mm_outputs({"req1"}, batch)
    assert torch.equal(cache.mm_outputs_cache["codes"].view(-1, 2)[8:12], expected)


# ---- 3. per-token tensors with more than two dims ---------------------------------------------


def test_three_dim_outputs_are_cached_and_merged():
    cache = make_cache()
    first = torch.rand(8, 4, 3)
    cache.update_omni_tensor_prefix_cache(None, {"codes": first}, 8, torch.arange(8, 16))
    assert "codes" in cache.mm_cache_keys
    assert cache.mm_outputs_cache["codes"].shape == (NUM_BLOCKS, BLOCK, 4, 3)
    cache.add_prefix_cached_new_req_id("req1")
    new = torch.rand(5, 4, 3)
    merged = cache.get_merged_multimodal_states([0, 3], FakeBatch(**HIT_BATCH), {"codes": new}, {"req1": 3, "req2": 2})
    assert torch.equal(merged["codes"]["req1"], torch.cat([first, new[:3]]))
    assert torch.equal(merged["codes"]["req2"], new[3:])


# ---- 4. dtype / trailing-shape mismatches -----------------------------------------------------


def test_mm_write_with_other_dtype_raises_and_writes_nothing():
    cache = make_cache()
    cache.maybe_init_missing_mm_cache_keys({"foo": torch.rand(4, 5), "bar": torch.rand(4, 2)}, 4)
    outputs = {"foo": torch.rand(4, 5), "bar": torch.rand(4, 2, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"'bar'.*torch\.float32.*torch\.float64"):
        cache.update_omni_tensor_prefix_cache(torch.rand(4, HIDDEN), outputs, 4, torch.arange(4))
    # The step is rejected whole: neither the good key nor the hidden states were written.
    assert torch.count_nonzero(cache.mm_outputs_cache["foo"]) == 0
    assert torch.count_nonzero(cache.hidden_states_cache) == 0


def test_mm_write_with_other_trailing_shape_raises():
    cache = make_cache()
    cache.maybe_init_missing_mm_cache_keys({"foo": torch.rand(4, 5)}, 4)
    with pytest.raises(ValueError, match=r"'foo'.*\(5,\).*\(6,\)"):
        cache.update_omni_tensor_prefix_cache(None, {"foo": torch.rand(4, 6)}, 4, torch.arange(4))


def test_hidden_write_with_other_dtype_raises_value_error():
    cache = make_cache()
    with pytest.raises(ValueError, match=r"'hidden_states'.*torch\.float32.*torch\.float16"):
        cache.update_omni_tensor_prefix_cache(torch.rand(4, HIDDEN, dtype=torch.float16), None, 4, torch.arange(4))


def test_merge_with_other_dtype_raises_value_error():
    cache = make_cache()
    cache.maybe_init_missing_mm_cache_keys({"foo": torch.rand(4, 5)}, 4)
    with pytest.raises(ValueError, match=r"'foo'.*torch\.float16"):
        cache.get_merged_multimodal_states(
            [0, 3], FakeBatch(**HIT_BATCH), {"foo": torch.rand(5, 5, dtype=torch.float16)}, {"req1": 3, "req2": 2}
        )


# ---- 5. 0-d passthrough -----------------------------------------------------------------------


def test_zero_dim_passthrough_is_cloned_to_every_request():
    cache = make_cache()
    scalar = torch.tensor(3.5)
    merged = cache.get_merged_multimodal_states(
        [0, 3], FakeBatch(**HIT_BATCH), {"temperature": scalar, "meta": {"n": torch.tensor(2)}}, {"req1": 3, "req2": 2}
    )
    assert torch.equal(merged["temperature"]["req1"], scalar) and torch.equal(merged["temperature"]["req2"], scalar)
    assert torch.equal(merged["meta"]["req2"]["n"], torch.tensor(2))
    merged["temperature"]["req1"] += 1
    assert merged["temperature"]["req2"].item() == 3.5 and scalar.item() == 3.5


# ---- 6. padding slots -------------------------------------------------------------------------


def test_padding_slots_are_skipped_for_hidden_and_mm():
    cache = make_cache()
    hidden, foo = torch.rand(4, HIDDEN), torch.rand(4, 5)
    slots = torch.tensor([8, -1, 9, -1])
    cache.update_omni_tensor_prefix_cache(hidden, {"foo": foo}, 4, slots)
    hs = cache.hidden_states_cache.view(-1, HIDDEN)
    fs = cache.mm_outputs_cache["foo"].view(-1, 5)
    assert torch.equal(hs[8], hidden[0]) and torch.equal(hs[9], hidden[2])
    assert torch.equal(fs[8], foo[0]) and torch.equal(fs[9], foo[2])
    assert torch.count_nonzero(hs[10:]) == 0 and torch.count_nonzero(fs[10:]) == 0  # -1 did not wrap to the end
    assert cache._hidden.valid.view(-1).nonzero().squeeze(1).tolist() == [8, 9]


def test_all_padding_step_writes_nothing():
    cache = make_cache()
    cache.update_omni_tensor_prefix_cache(torch.rand(2, HIDDEN), None, 2, torch.tensor([-1, -1], dtype=torch.int32))
    assert torch.count_nonzero(cache.hidden_states_cache) == 0 and not cache._hidden.valid.any()


# ---- 8. errors for bad input ------------------------------------------------------------------


@pytest.mark.parametrize(
    "slots, match",
    [
        ([0, 40], r"\[0, 40\).*40"),
        ([0, -2], r"-1 \(padding\).*-2"),
        ([0], r"at least 2 slots"),
        ([0.0, 1.0], r"integer"),
        ([True, False], r"integer"),
    ],
)
def test_bad_slot_mapping_raises_value_error(slots, match):
    cache = make_cache()
    with pytest.raises(ValueError, match=match):
        cache.update_omni_tensor_prefix_cache(torch.rand(2, HIDDEN), None, 2, torch.tensor(slots))
    assert not cache._hidden.valid.any()


def test_short_mm_output_raises_value_error():
    cache = make_cache()
    cache.maybe_init_missing_mm_cache_keys({"foo": torch.rand(4, 5)}, 4)
    with pytest.raises(ValueError, match=r"'foo'.*at least 4 rows.*\(3, 5\)"):
        cache.update_omni_tensor_prefix_cache(None, {"foo": torch.rand(3, 5)}, 4, torch.arange(4))


def test_registered_key_with_non_tensor_value_raises_value_error():
    cache = make_cache()
    cache.maybe_init_missing_mm_cache_keys({"foo": torch.rand(4, 5)}, 4)
    with pytest.raises(ValueError, match=r"'foo'.*list"):
        cache.get_merged_multimodal_states([0, 3], FakeBatch(**HIT_BATCH), {"foo": [1, 2]}, {"req1": 3, "req2": 2})


def test_missing_scheduled_count_raises_value_error():
    cache = make_cache()
    with pytest.raises(ValueError, match="req2"):
        cache.get_merged_hidden_states([0, 3], FakeBatch(**HIT_BATCH), torch.rand(5, HIDDEN), {"req1": 3})


def test_hit_past_allocated_blocks_raises():
    cache = make_cache()
    write_hidden(cache, list(range(8, 16)))
    cache.add_prefix_cached_new_req_id("req1")
    batch = FakeBatch(rows=[[2, 3, 0, 0], [6, 0, 0, 0]], num_computed=[8, 0], allocated=[1, 1])
    with pytest.raises(RuntimeError, match=r"2 full blocks.*only 1"):
        merge_hidden(cache, batch, torch.rand(5, HIDDEN), [3, 2])


def test_bad_constructor_arguments_raise_value_error():
    with pytest.raises(ValueError, match="block_size"):
        OmniTensorPrefixCache(num_blocks=4, block_size=0, hidden_size=2, hs_dtype=torch.float32)


# ---- merge shape and cost ---------------------------------------------------------------------


def test_misses_are_views_and_hits_one_fresh_buffer():
    cache = make_cache()
    write_hidden(cache, list(range(8, 16)))
    cache.add_prefix_cached_new_req_id("req1")
    new = torch.rand(5, HIDDEN)
    merged = merge_hidden(cache, FakeBatch(**HIT_BATCH), new, [3, 2])
    assert merged["req2"].untyped_storage().data_ptr() == new.untyped_storage().data_ptr()
    assert merged["req1"].untyped_storage().data_ptr() != new.untyped_storage().data_ptr()
    assert merged["req1"].untyped_storage().data_ptr() != cache.hidden_states_cache.untyped_storage().data_ptr()


def test_merge_follows_query_start_loc_when_rows_are_not_in_batch_order():
    cache = make_cache()
    batch = FakeBatch(**HIT_BATCH)
    new = torch.rand(5, HIDDEN)
    # req2 (row 1) owns packed rows 0..1, req1 (row 0) owns rows 2..4.
    merged = cache.get_merged_hidden_states([2, 0], batch, new, {"req1": 3, "req2": 2})
    assert torch.equal(merged["req1"], new[2:]) and torch.equal(merged["req2"], new[:2])
    assert list(merged) == ["req1", "req2"]


@pytest.mark.parametrize("hidden", [3, 4], ids=["element_copy", "wide_copy"])
def test_round_trip_through_real_input_batch(hidden):
    """Prefill a request, then a new request hitting its two full blocks gets the
    first request's rows for its prefix, with the cache's own block lookup."""
    from omnistage.sampling_params import SamplingParams
    from omnistage.worker.input_batch import InputBatch

    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=BLOCK)
    prompt = list(range(10))
    batch.add_request("a", prompt, 10, 0, [4, 1, 7], SamplingParams())
    step = batch.prepare_step({"a": 10})
    prefill = torch.rand(10, hidden)
    cache = make_cache(hidden=hidden)
    assert (cache._hidden.wide is not None) == (hidden == 4)
    cache.invalidate_blocks([4, 1, 7])  # fresh blocks for "a"
    cache.update_omni_tensor_prefix_cache(prefill, None, step.num_tokens, step.slot_mapping)
    batch.remove_request("a")

    batch.add_request("b", prompt, 10, 8, [4, 1, 9], SamplingParams())  # hits blocks 4, 1
    cache.invalidate_blocks([9])
    cache.add_prefix_cached_new_req_id("b")
    step = batch.prepare_step({"b": 2})
    new = torch.rand(2, hidden)
    cache.update_omni_tensor_prefix_cache(new, None, step.num_tokens, step.slot_mapping)
    merged = cache.get_merged_hidden_states(step.query_start_loc, batch, new, {"b": 2})
    assert torch.equal(merged["b"], torch.cat([prefill[:8], new]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_device_inputs_are_cached_and_merged_on_cpu():
    cache = make_cache()
    assert cache.hidden_states_cache.is_pinned()
    hidden = torch.rand(8, HIDDEN, device="cuda")
    codes = torch.rand(8, 4, 3, device="cuda")
    slots = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15], device="cuda")
    cache.update_omni_tensor_prefix_cache(hidden, {"codes": codes}, 8, slots)
    cache.add_prefix_cached_new_req_id("req1")
    new_hidden, new_codes = torch.rand(5, HIDDEN, device="cuda"), torch.rand(5, 4, 3, device="cuda")
    batch = FakeBatch(**HIT_BATCH)
    merged = merge_hidden(cache, batch, new_hidden, [3, 2])
    assert merged["req1"].device.type == "cpu" and merged["req2"].device.type == "cpu"
    assert torch.equal(merged["req1"], torch.cat([hidden, new_hidden[:3]]).cpu())
    mm = cache.get_merged_multimodal_states([0, 3], batch, {"codes": new_codes}, {"req1": 3, "req2": 2})
    assert torch.equal(mm["codes"]["req1"], torch.cat([codes, new_codes[:3]]).cpu())
    cache.stage_deferred_mm_outputs([0, 3], batch, {"audio": new_codes}, {"req1": 3, "req2": 2}, {"audio"})
    cache.commit_deferred_mm_outputs({"req1"}, batch)  # positions 5..7 of req1: block 3
    assert torch.equal(cache.mm_outputs_cache["audio"].view(-1, 4, 3)[13:16], new_codes[:3].cpu())


def test_bit_patterns_survive_the_wide_copy():
    """Rows are copied as 16-byte elements; NaN payloads and denormals must come back unchanged."""
    cache = OmniTensorPrefixCache(num_blocks=NUM_BLOCKS, block_size=BLOCK, hidden_size=8, hs_dtype=torch.bfloat16)
    assert cache._hidden.wide is not None
    bits = torch.randint(-(2**15), 2**15, (12, 8), dtype=torch.int16)
    slots = torch.randperm(NUM_BLOCKS * BLOCK)[:12]
    cache.update_omni_tensor_prefix_cache(bits.view(torch.bfloat16), None, 12, slots)
    assert torch.equal(cache.hidden_states_cache.view(-1, 8)[slots].view(torch.int16), bits)
