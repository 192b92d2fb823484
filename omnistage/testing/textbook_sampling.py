"""Sampling by its textbook definition, the reference the sampler is tested and benchmarked against.

- :func:`textbook_top_k_top_p`: top-k, then top-p by a full sort of each row
  (transformers' warpers): drop the tokens whose ascending cumulative
  probability stays within ``1 - p``, never the likeliest;
- :func:`textbook_sample_random`: a draw by exponential race,
  ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token.

``worker/sampler.py`` computes the same masks without sorting and draws with
one uniform per row.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["textbook_sample_random", "textbook_top_k_top_p"]

_NEG_INF = float("-inf")


def textbook_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with the tokens outside each row's top-k and top-p sets at -inf, by sorting."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def textbook_sample_random(logits: torch.Tensor, md: Any, default_generator: torch.Generator | None) -> torch.Tensor:
    """``Sampler._sample_random`` by exponential race: a random number per token and row."""
    from omnistage.worker.sampler import Sampler

    probs = Sampler.target_probs(logits, md)
    q = torch.empty_like(probs)
    q.exponential_(generator=default_generator)
    for row, gen in md.generators.items():
        q[row].exponential_(generator=gen)
    return (probs / q).argmax(dim=-1)
