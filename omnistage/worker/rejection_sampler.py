"""Verification of draft tokens: which drafts a request keeps, and the token after them.

A speculating request has ``k`` drafts and ``k + 1`` rows of target logits
(the positions of its last known token and of each draft). Policy, vLLM's:

- Greedy rows keep drafts while each equals the target's argmax at its
  position, then emit the argmax at the first mismatch, or the argmax after
  the last draft (the bonus token) when all were kept.
- Random rows: a draft is deterministic (prompt lookup's, and an EAGLE
  head's argmax), so its distribution is one-hot at the draft ``d``, and
  the rejection rule keeps ``d`` with probability ``p(d)`` (``p`` the
  target's sampling distribution at that position: temperature, top-k/p,
  min-p applied, as the plain sampler draws) and otherwise draws from ``p``
  with ``d`` removed. That is exactly drawing a token from ``p`` and keeping
  the draft if the two are equal, which is how it is done here: each
  position's token is drawn as the plain sampler draws it (one uniform
  through ``p``'s cumulative weights), up to the first that differs from its
  draft or the one after the last draft (the bonus token).
- So a request draws once per emitted token, as without speculation, from
  its own generator when it is seeded (else the engine's): a seeded request
  emits the tokens it emits with speculation off, whatever its drafts, the
  draft policy's allocation or the rest of the batch (up to the fp32
  rounding of the multi-row forward).
"""

from __future__ import annotations

import torch

from omnistage.kernels.argmax import first_argmax
from omnistage.worker.sampler import Sampler, SamplingMetadata, draw_rows, uniform


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalized non-negative ``[V]`` weights, as the plain sampler draws it."""
    return int(draw_rows(weights.unsqueeze(0), uniform(generator, weights.device).unsqueeze(0)))


def accept_random(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """Tokens one random request emits: ``probs`` is ``[k + 1, V]`` (unnormalized
    sampling weights at each position), ``drafts`` its ``k`` drafts."""
    out: list[int] = []
    for j, row in enumerate(probs):
        out.append(draw(row, generator))
        if j == len(drafts) or out[-1] != drafts[j]:
            break
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
