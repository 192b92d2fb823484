"""Logit rules that read a request's token history or a per-request token set.

``TokenHistory`` keeps, per persistent-batch row, how often each token appears
in the row's output and whether it appears in its prompt, as ``[rows, V]``
tensors updated with one scatter per step. ``PenaltyMetadata`` and
``TokenMask`` carry one step's slice of that state to the sampler, which
applies them in one batched pass (no loop over requests or the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_NEG_INF = float("-inf")
_FLOAT32_MAX = torch.finfo(torch.float32).max


def flat_ranges(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(row, index)`` with ``starts[i] <= index < ends[i]`` for ``row = rows[i]``, flattened."""
    counts = ends - starts
    total = int(counts.sum())
    offsets = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    index = np.repeat(starts - offsets, counts) + np.arange(total)
    return np.repeat(rows, counts), index


class TokenHistory:
    """Output-token counts and prompt-token masks of the rows that have penalties.

    ``output_counts[row, t]`` is how often token ``t`` was sampled by the
    row's request, ``prompt_mask[row, t]`` whether its prompt holds ``t``.
    The ``[max_num_reqs, V]`` tensors are allocated when the first penalized
    request arrives, so an engine that never sees a penalty pays nothing.

    Rows are brought up to date lazily, by :meth:`sync`, when they sample: a
    row that got a (new, resumed or moved) request is rebuilt from the
    batch's token ids, then each step adds the tokens appended since. The
    batch's token ids are the truth; this is a cache of them.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts: torch.Tensor | None = None  # [max_num_reqs, V] int32
        self.prompt_mask: torch.Tensor | None = None  # [max_num_reqs, V] bool
        # How many of the row's tokens are counted; -1: rebuild at the next sync.
        self.synced = np.full(max_num_reqs, -1, dtype=np.int64)

    def reset_row(self, row: int) -> None:
        """The row got a request: its counts are rebuilt when it next samples."""
        self.synced[row] = -1
        if self.output_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def sync(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray, num_prompt: np.ndarray) -> None:
        """Count the tokens of ``rows`` not counted yet.

        ``token_ids`` is the batch's ``[max_num_reqs, max_model_len]`` array,
        ``num_tokens`` / ``num_prompt`` its per-row lengths (all rows).
        """
        assert self.output_counts is not None and self.prompt_mask is not None
        end = num_tokens[rows]
        fresh = rows[(self.synced[rows] < 0) | (self.synced[rows] > end)]
        if len(fresh):
            fresh_t = torch.from_numpy(fresh).to(self.device)
            self.output_counts.index_fill_(0, fresh_t, 0)
            self.prompt_mask.index_fill_(0, fresh_t, False)
            r, i = flat_ranges(fresh, np.zeros_like(fresh), num_prompt[fresh])
            if len(r):
                tokens = torch.from_numpy(token_ids[r, i]).to(self.device)
                self.prompt_mask[torch.from_numpy(r).to(self.device), tokens] = True
            self.synced[fresh] = num_prompt[fresh]
        r, i = flat_ranges(rows, self.synced[rows], end)
        if len(r):
            index = (torch.from_numpy(r).to(self.device), torch.from_numpy(token_ids[r, i]).to(self.device))
            ones = torch.ones(len(r), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, ones, accumulate=True)
        self.synced[rows] = end


@dataclass
class PenaltyMetadata:
    """Penalties of the ``P`` sampling rows that have any, vLLM's semantics.

    ``index`` says which of the step's ``S`` logits rows they are (None: all,
    in order). A neutral value (repetition 1, presence or frequency 0) leaves
    a row's logits bit-identical, so rows mix freely.
    """

    index: torch.Tensor | None  # [P] int64
    output_counts: torch.Tensor  # [P, V] int32
    prompt_mask: torch.Tensor  # [P, V] bool
    repetition: torch.Tensor | None  # [P] fp32; None when no row has one
    presence: torch.Tensor | None  # [P] fp32
    frequency: torch.Tensor | None  # [P] fp32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized copy of ``[S, V]`` fp32 ``logits``: repetition, then frequency, then presence."""
        rows = logits if self.index is None else logits.index_select(0, self.index)
        rows = apply_penalties(
            rows, self.output_counts, self.prompt_mask, self.repetition, self.presence, self.frequency
        )
        return rows if self.index is None else logits.index_copy(0, self.index, rows)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor | None,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
) -> torch.Tensor:
    """``[P, V]`` logits with the penalties applied (out of place).

    Repetition is ``transformers``' RepetitionPenaltyLogitsProcessor over
    prompt and output (a seen token's logit is multiplied by the penalty when
    negative, divided when not); frequency and presence subtract
    ``penalty * count`` and ``penalty * (count > 0)`` over the output, as vLLM
    and OpenAI define them.
    """
    in_output = output_counts > 0
    if repetition is not None:
        p = repetition.unsqueeze(1)
        # Divided by a tiny penalty a logit can pass float32's range: +inf would make the row's
        # softmax NaN, so it stops at the largest finite value (still the likeliest token).
        penalized = torch.where(logits < 0, logits * p, (logits / p).clamp_(max=_FLOAT32_MAX))
        logits = torch.where(prompt_mask | in_output, penalized, logits)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * output_counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * in_output
    return logits


@dataclass
class TokenMask:
    """Tokens that ``B`` of the step's sampling rows may never sample."""

    index: torch.Tensor | None  # [B] int64 positions among the S rows; None: all, in order
    mask: torch.Tensor  # [B, V] bool, True = never sampled

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return logits.masked_fill(self.mask, _NEG_INF)
        rows = logits.index_select(0, self.index).masked_fill(self.mask, _NEG_INF)
        return logits.index_copy(0, self.index, rows)
