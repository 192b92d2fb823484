"""InputBatch: dense rows, packed steps, slot mapping within allocated blocks."""

import numpy as np
import pytest
import torch

from omnistage.sampling_params import SamplingParams
from omnistage.worker.input_batch import InputBatch

BLOCK = 4


def make_batch() -> InputBatch:
    batch = InputBatch(max_num_reqs=4, max_model_len=32, block_size=BLOCK)
    batch.add_request("a", list(range(100, 110)), 10, 4, [3, 7, 9], SamplingParams())
    batch.add_request("b", [5, 6, 7], 3, 0, [1], SamplingParams(seed=1))
    return batch


def test_prepare_step_packs_tokens_positions_and_slots():
    step = make_batch().prepare_step({"a": 6, "b": 3})
    assert step.req_ids == ["a", "b"]
    assert step.input_ids.tolist() == [104, 105, 106, 107, 108, 109, 5, 6, 7]
    assert step.positions.tolist() == [4, 5, 6, 7, 8, 9, 0, 1, 2]
    # a: positions 4..7 in block 7, 8..9 in block 9; b: block 1.
    assert step.slot_mapping.tolist() == [28, 29, 30, 31, 36, 37, 4, 5, 6]
    assert step.query_start_loc.tolist() == [0, 6, 9]
    assert step.seq_lens.tolist() == [10, 3]
    assert step.logits_indices.tolist() == [5, 8]
    assert step.sampling_req_ids == ["a", "b"]
    assert step.block_table.tolist() == [[3, 7, 9], [1, 0, 0]]


def test_partial_prefill_chunk_samples_nothing():
    step = make_batch().prepare_step({"a": 2, "b": 3})
    assert step.sampling_req_ids == ["b"]
    assert step.logits_indices.tolist() == [4]


def test_unscheduled_requests_are_left_out():
    step = make_batch().prepare_step({"b": 1})
    assert step.req_ids == ["b"]
    assert step.num_tokens == 1


def test_remove_keeps_rows_dense_and_moves_block_rows():
    batch = make_batch()
    batch.add_request("c", [1, 2], 2, 0, [5], SamplingParams())
    assert batch.remove_request("a") == 0
    assert batch.req_ids == ["c", "b"]
    assert batch.req_id_to_index == {"c": 0, "b": 1}
    assert batch.block_table[0].row_block_ids(0).tolist() == [5]
    assert batch.token_ids_cpu[0, :2].tolist() == [1, 2]
    assert batch.remove_request("missing") is None


def test_append_token_and_update_extend_the_request():
    batch = make_batch()
    batch.update_request("b", [2], 3)
    batch.append_token("b", 42)
    step = batch.prepare_step({"b": 1})
    assert step.input_ids.tolist() == [42]
    assert step.positions.tolist() == [3]
    assert step.slot_mapping.tolist() == [1 * BLOCK + 3]
    batch.update_request("b", [], 4)
    batch.append_token("b", 43)
    assert batch.prepare_step({"b": 1}).slot_mapping.tolist() == [2 * BLOCK + 0]


def test_scheduling_past_allocated_blocks_is_an_error():
    batch = make_batch()
    batch.append_token("b", 9)
    batch.append_token("b", 9)
    with pytest.raises(RuntimeError, match="allocated blocks"):
        batch.prepare_step({"b": 5})


def test_scheduling_past_known_tokens_is_an_error():
    with pytest.raises(RuntimeError, match="only 3 tokens are known"):
        make_batch().prepare_step({"b": 4})


def test_bad_requests_are_rejected_without_side_effects():
    batch = make_batch()
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request("a", [1], 1, 0, [2], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len=32"):
        batch.add_request("d", list(range(40)), 40, 0, [2], SamplingParams())
    assert batch.req_ids == ["a", "b"]


def test_seeded_requests_get_their_own_generator():
    batch = make_batch()
    assert "b" in batch.generators and "a" not in batch.generators
    expected = torch.Generator().manual_seed(1)
    assert torch.equal(torch.rand(3, generator=batch.generators["b"]), torch.rand(3, generator=expected))


def test_prefix_cache_surface():
    batch = make_batch()
    assert isinstance(batch.num_computed_tokens_cpu, np.ndarray)
    assert len(batch.block_table.block_tables) == 1
    assert batch.block_table[0].block_table.cpu[0, :3].tolist() == [3, 7, 9]
    assert batch.block_table[0].num_blocks_per_row[:2].tolist() == [3, 1]
