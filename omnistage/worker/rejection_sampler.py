"""Verification of draft tokens: which drafts a request keeps, and the token after them.

A speculating request has ``k`` drafts and ``k + 1`` rows of target logits
(the positions of its last known token and of each draft). Policy, vLLM's:

- Greedy rows keep drafts while each equals the target's argmax at its
  position, then emit the argmax at the first mismatch, or the argmax after
  the last draft (the bonus token) when all were kept.
- Random rows: an n-gram draft is deterministic (its distribution is one-hot
  at the draft ``d``), so draft ``d`` is kept with probability ``p(d)``, the
  target's sampling distribution at that position (temperature, top-k/p,
  min-p applied, as the plain sampler draws). On rejection the token is drawn
  from ``p`` with ``d`` removed and renormalized, which makes the emitted
  token's distribution exactly ``p``; after ``k`` kept drafts the bonus token
  is drawn from the last row's ``p``.
- Draws come from the request's own generator when it is seeded (in a fixed
  order: one uniform per verified draft, one exponential race per emitted
  non-draft token), else from the engine's, so seeded runs repeat themselves.
"""

from __future__ import annotations

import torch

from omnistage.kernels.argmax import first_argmax
from omnistage.worker.sampler import Sampler, SamplingMetadata


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalized non-negative ``[V]`` weights (exponential race)."""
    q = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / q).argmax())


def accept_random(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """Tokens one random request emits: ``probs`` is ``[k + 1, V]`` (unnormalized
    sampling weights at each position), ``drafts`` its ``k`` drafts."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        row = probs[j]
        total = float(row.sum())
        p_d = float(row[d])
        u = float(torch.rand((), generator=generator, device=row.device))
        if u * total < p_d:
            out.append(d)
            continue
        residual = row.clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p(d) == 1 up to rounding: nothing else can be drawn
            out.append(d)
            continue
        out.append(draw(residual, generator))
        return out
    out.append(draw(probs[len(drafts)], generator))
    return out


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """Tokens one greedy request emits, given the target's argmax at its ``k + 1`` positions."""
    out: list[int] = []
    for d, t in zip(drafts, targets):
        out.append(t)
        if d != t:
            return out
    out.append(targets[len(drafts)])
    return out


class RejectionSampler:
    """Batched verification over the ``sum(k_i + 1)`` rows of the speculating requests."""

    def __call__(
        self,
        logits: torch.Tensor | None,
        md: SamplingMetadata,
        drafts: list[list[int]],
        default_generator: torch.Generator | None,
        greedy_token_ids: torch.Tensor | None = None,
    ) -> list[list[int]]:
        """``logits`` are the raw target logits of every row (None only when
        ``greedy_token_ids``, the rows' argmax, is given for an all plain-greedy
        batch); ``md`` is the sampling metadata of those rows, each request's
        row repeated once per position. Returns each request's emitted tokens."""
        targets: list[int] | None = None
        probs = None
        if greedy_token_ids is not None:
            targets = greedy_token_ids.tolist()
        else:
            assert logits is not None
            ruled = Sampler.apply_logit_rules(logits.float(), md)
            if md.all_greedy or md.greedy is not None:
                targets = first_argmax(ruled).tolist()
            if not md.all_greedy:
                probs = Sampler.target_probs(ruled, md)
        greedy = None if md.greedy is None else md.greedy.tolist()
        out: list[list[int]] = []
        offset = 0
        for request_drafts in drafts:
            rows = len(request_drafts) + 1
            if md.all_greedy or (greedy is not None and greedy[offset]):
                assert targets is not None
                out.append(accept_greedy(targets[offset : offset + rows], request_drafts))
            else:
                assert probs is not None
                generator = md.generators.get(offset, default_generator)
                out.append(accept_random(probs[offset : offset + rows], request_drafts, generator))
            offset += rows
        return out
