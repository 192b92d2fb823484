"""Speculative decoding, scheduler side: the configuration and the proposers' seam.

Plain Python. Two ways drafts come about:

- ``ngram``: proposed here, at schedule time, from the request's own token
  ids (``propose_ngram``).
- ``eagle``: proposed by the worker's drafter after a step's target forward
  (it needs the target's hidden states); the scheduler asks for them per
  request (``SchedulerOutput.draft_token_requests``), keeps what comes back
  (``ModelRunnerOutput.draft_token_ids``) and schedules it the next step
  (``take_worker_drafts``).

Either way verification (one forward over all draft positions, rejection
sampling) is the worker's (``worker/rejection_sampler.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

# Methods vLLM names that this engine does not run yet: refused by name.
_NOT_YET = {"eagle3", "medusa", "mtp", "draft_model", "suffix"}
_SUPPORTED = "'ngram', 'eagle'"
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "eagle": {"method", "model", "num_speculative_tokens"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}``
    or ``{"method": "eagle", "model": "<drafter folder>", "num_speculative_tokens": k}``.

    ``model`` is the EAGLE head's checkpoint folder (``eagle`` only; the
    prompt-lookup bounds are 0 there). ``banned_token_ids`` are never proposed (multimodal placeholder ids: a
    draft of a pad id could only be rejected); ``word_piece_ids`` are the tokens that continue a word
    rather than start one (the draft policy prices drafts inside split words apart). The engine fills
    both from the model and its tokenizer; they are not user keys.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    banned_token_ids: frozenset[int] = field(default_factory=frozenset)
    word_piece_ids: frozenset[int] = field(default_factory=frozenset)
    model: str | None = None

    @property
    def uses_drafter(self) -> bool:
        """Drafts come from the worker's drafter (after each target forward), not the scheduler."""
        return self.method == "eagle"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """Validate a user's ``speculative_config``; ``ValueError`` names the bad key."""
        where = "speculative_config"
        if not isinstance(config, dict):
            raise ValueError(f"{where} must be a dict (JSON object), got {type(config).__name__}")  # noqa: TRY004
        method = config.get("method")
        if method is None:
            raise ValueError(f"{where}: 'method' is required; supported: {_SUPPORTED}")
        if method in _NOT_YET:
            raise ValueError(f"{where}: method {method!r} is not supported yet; supported: {_SUPPORTED}")
        if method not in _KEYS:
            raise ValueError(f"{where}: unknown method {method!r}; supported: {_SUPPORTED}")
        keys = _KEYS[method]
        unknown = sorted(set(config) - keys)
        if unknown:
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r} for method {method!r}; expected some of {sorted(keys)}"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError(f"{where}: 'num_speculative_tokens' is required for method {method!r}")
        k = config["num_speculative_tokens"]
        if method == "eagle":
            model = config.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"{where}: 'model' (the EAGLE head's checkpoint folder) is required, got {model!r}")
            _check_positive(where, "num_speculative_tokens", k)
            return cls("eagle", k, 0, 0, model=model)
        # vLLM's defaults when a bound is left out: the other bound, else 1..3.
        n_min = config.get("prompt_lookup_min", 1)
        n_max = config.get("prompt_lookup_max", max(3, n_min) if isinstance(n_min, int) else 3)
        for key, value in (("num_speculative_tokens", k), ("prompt_lookup_max", n_max), ("prompt_lookup_min", n_min)):
            _check_positive(where, key, value)
        if n_min > n_max:
            raise ValueError(f"{where}: 'prompt_lookup_min'={n_min} exceeds 'prompt_lookup_max'={n_max}")
        return cls("ngram", k, n_max, n_min)

    def for_model(self, banned: Collection[int], word_pieces: Collection[int]) -> SpeculativeConfig:
        """This config with the model's ``banned_token_ids`` and ``word_piece_ids``."""
        banned_ids, piece_ids = frozenset(int(t) for t in banned), frozenset(int(t) for t in word_pieces)
        return dataclasses.replace(self, banned_token_ids=banned_ids, word_piece_ids=piece_ids)


def _check_positive(where: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key!r} must be an integer >= 1, got {value!r}")


def take_worker_drafts(drafts: Sequence[int], k: int, banned: Collection[int] = ()) -> list[int]:
    """The part of a drafter's proposal the scheduler verifies: at most ``k``
    tokens, cut before the first banned (placeholder) id."""
    out = list(drafts[: max(k, 0)])
    for i, t in enumerate(out):
        if t in banned:
            return out[:i]
    return out


def propose_ngram(
    token_ids: Sequence[int], k: int, min_n: int, max_n: int, banned: Collection[int] = ()
) -> tuple[list[int], int]:
    """Prompt lookup: up to ``k`` tokens that followed an earlier occurrence of
    the longest suffix n-gram (``min_n <= n <= max_n``) of ``token_ids``, and
    where they start in ``token_ids`` (-1 when nothing matches), which tells a
    copy of the prompt from a repeat of the request's own output.

    Policy: the longest n that matches wins; among its matches the latest
    one (the most recent context is the likeliest to repeat). The draft is cut
    before the first banned id (placeholders are never proposed) and at the
    end of the history. Empty when nothing matches.
    """
    num = len(token_ids)
    if k < 1 or num < min_n + 1:
        return [], -1
    tokens = token_ids
    last = tokens[-1]
    best_len, best_end = 0, -1
    # One scan from the right over the ends of candidate matches (each must
    # have a token after it); a match only replaces a strictly shorter one, so
    # the latest of the longest wins. O(len * max_n) in the worst case.
    for end in range(num - 2, -1, -1):
        if tokens[end] != last:
            continue
        length = 1
        while length < max_n and length <= end and tokens[end - length] == tokens[num - 1 - length]:
            length += 1
        if length > best_len:
            best_len, best_end = length, end
            if length == max_n:
                break
    if best_len < min_n:
        return [], -1
    draft = list(tokens[best_end + 1 : best_end + 1 + k])
    for i, t in enumerate(draft):
        if t in banned:
            return draft[:i], best_end + 1
    return draft, best_end + 1
