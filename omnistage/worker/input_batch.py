"""The worker's persistent batch: one row per running request.

Rows stay dense (a removed request's hole is filled by the last row), so a
step's arrays are built with a few vectorized numpy operations rather than a
loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omnistage.sampling_params import SamplingParams


class CpuGpuBuffer:
    """A host tensor and its device mirror (the same tensor on CPU)."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.zeros(*shape, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros(*shape, dtype=dtype, device=device)


class BlockTable:
    """Block ids of each row for one KV-cache group.

    ``num_blocks_per_row[i]`` entries of row ``i`` are allocated to its
    request; the rest of the row is unused and never addressed.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table = CpuGpuBuffer(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks_per_row[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"block table row {row} would hold {end} blocks, more than the "
                f"{self.max_num_blocks_per_req} a request may have"
            )
        self.block_table.np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.block_table.np[dst, :n] = self.block_table.np[src, :n]
        self.num_blocks_per_row[dst] = n
        self.num_blocks_per_row[src] = 0

    def clear_row(self, row: int) -> None:
        self.num_blocks_per_row[row] = 0

    def row_block_ids(self, row: int) -> np.ndarray:
        return self.block_table.np[row, : self.num_blocks_per_row[row]]

    def compute_slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """KV slot (``block_id * block_size + offset``) of each (row, position)."""
        block_idx = positions // self.block_size
        if len(rows) and np.any(block_idx >= self.num_blocks_per_row[rows]):
            bad = int(np.argmax(block_idx >= self.num_blocks_per_row[rows]))
            raise RuntimeError(
                f"position {int(positions[bad])} of block-table row {int(rows[bad])} lies past its "
                f"{int(self.num_blocks_per_row[rows[bad]])} allocated blocks"
            )
        block_ids = self.block_table.np[rows, block_idx].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size


class MultiGroupBlockTable:
    """Block tables of every KV-cache group (omnistage uses one group)."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, device: torch.device) -> None:
        self.block_tables = [BlockTable(max_num_reqs, max_num_blocks_per_req, block_size, device)]

    def __getitem__(self, group: int) -> BlockTable:
        return self.block_tables[group]

    def add_row(self, row: int, block_ids: list[int]) -> None:
        for table in self.block_tables:
            table.add_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        for table in self.block_tables:
            table.append_row(row, block_ids)

    def move_row(self, src: int, dst: int) -> None:
        for table in self.block_tables:
            table.move_row(src, dst)

    def clear_row(self, row: int) -> None:
        for table in self.block_tables:
            table.clear_row(row)


@dataclass
class BatchStep:
    """One step's packed (unpadded) batch, in batch order.

    Only requests with scheduled tokens appear. ``query_start_loc[i]`` is the
    offset of request ``i``'s first token in the packed batch.
    """

    req_ids: list[str]
    rows: np.ndarray  # persistent-batch row of each request
    num_scheduled_tokens: np.ndarray  # [R]
    query_start_loc: np.ndarray  # [R + 1]
    num_computed_tokens: np.ndarray  # [R], before this step
    prefill_lens: np.ndarray  # [R], prompt lengths
    seq_lens: np.ndarray  # [R], context length after this step
    num_tokens: int
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens], int64
    block_table: torch.Tensor  # [R, max_blocks_in_step], int32
    logits_indices: torch.Tensor  # [S], packed index of the last token of each sampling request
    sampling_req_ids: list[str]  # the S requests that sample a token this step


class InputBatch:
    """Token ids, progress, block tables and sampling settings per request."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int64)
        # M-RoPE models: a generated token at index p sits at p + delta on every
        # axis (see models.mm_adapter.MRopePositions); 0 for everything else.
        self.mrope_delta = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = MultiGroupBlockTable(max_num_reqs, max_blocks, block_size, self.device)
        self.sampling_params: dict[str, SamplingParams] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.num_output_tokens: dict[str, int] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        num_computed_tokens: int,
        block_ids: list[int],
        sampling_params: SamplingParams,
    ) -> int:
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} is already in the batch")
        # The sampler's arrays and the request's generator take these values;
        # a value past them is refused here, before the batch changes.
        try:
            sampling_params.validate()
        except ValueError as e:
            raise ValueError(f"request {req_id!r}: {e}") from None
        if self.num_reqs >= self.max_num_reqs:
            raise RuntimeError(f"the batch is full ({self.max_num_reqs} requests); cannot add {req_id!r}")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"request {req_id!r} has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        row = self.num_reqs
        self.req_ids.append(req_id)
        self.req_id_to_index[req_id] = row
        self.token_ids_cpu[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens_cpu[row] = num_computed_tokens
        self.mrope_delta[row] = 0
        self.block_table.add_row(row, block_ids)
        self.sampling_params[req_id] = sampling_params
        self.num_output_tokens[req_id] = len(token_ids) - num_prompt_tokens
        if sampling_params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sampling_params.seed)
            self.generators[req_id] = gen
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Drop a request; the last row moves into its place. Returns the freed row."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        last = self.num_reqs - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.req_id_to_index[moved] = row
            n = int(self.num_tokens[last])
            self.token_ids_cpu[row, :n] = self.token_ids_cpu[last, :n]
            self.num_tokens[row] = n
            self.num_prompt_tokens[row] = self.num_prompt_tokens[last]
            self.num_computed_tokens_cpu[row] = self.num_computed_tokens_cpu[last]
            self.mrope_delta[row] = self.mrope_delta[last]
            self.block_table.move_row(last, row)
        else:
            self.block_table.clear_row(row)
        self.req_ids.pop()
        self.sampling_params.pop(req_id, None)
        self.generators.pop(req_id, None)
        self.num_output_tokens.pop(req_id, None)
        return row

    def update_request(self, req_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        row = self.req_id_to_index[req_id]
        self.block_table.append_row(row, new_block_ids)
        self.num_computed_tokens_cpu[row] = num_computed_tokens

    def append_token(self, req_id: str, token_id: int) -> None:
        row = self.req_id_to_index[req_id]
        n = int(self.num_tokens[row])
        if n >= self.max_model_len:
            raise RuntimeError(f"request {req_id!r} is already at max_model_len={self.max_model_len}")
        self.token_ids_cpu[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.num_output_tokens[req_id] += 1

    def prepare_step(self, num_scheduled_tokens: dict[str, int]) -> BatchStep:
        """Pack the scheduled tokens of this step, in batch order."""
        req_ids = [r for r in self.req_ids if num_scheduled_tokens.get(r, 0) > 0]
        rows = np.fromiter((self.req_id_to_index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter((num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        computed = self.num_computed_tokens_cpu[rows]
        seq_lens = computed + num_sched
        over = seq_lens > self.num_tokens[rows]
        if over.any():
            i = int(np.argmax(over))
            raise RuntimeError(
                f"request {req_ids[i]!r} was scheduled up to token {int(seq_lens[i])} "
                f"but only {int(self.num_tokens[rows[i]])} tokens are known"
            )
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        token_rows = np.repeat(rows, num_sched)
        positions = np.repeat(computed - query_start_loc[:-1], num_sched) + np.arange(total)
        input_ids = self.token_ids_cpu[token_rows, positions]
        table = self.block_table[0]
        slot_mapping = table.compute_slot_mapping(token_rows, positions)
        max_blocks = int(table.num_blocks_per_row[rows].max()) if len(rows) else 0
        samples = seq_lens == self.num_tokens[rows]
        dev = self.device
        return BatchStep(
            req_ids=req_ids,
            rows=rows,
            num_scheduled_tokens=num_sched,
            query_start_loc=query_start_loc,
            num_computed_tokens=computed,
            prefill_lens=self.num_prompt_tokens[rows],
            seq_lens=seq_lens,
            num_tokens=total,
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            block_table=table.block_table.cpu[torch.from_numpy(rows), :max_blocks].to(dev),
            logits_indices=torch.from_numpy(query_start_loc[1:][samples] - 1).to(dev),
            sampling_req_ids=[r for r, s in zip(req_ids, samples) if s],
        )
