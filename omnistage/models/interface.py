"""What a model declares about the per-token tensors its downstream stage needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["NO_TENSOR_CACHE", "TensorCachePolicy", "tensor_cache_policy_of"]


@dataclass(frozen=True)
class TensorCachePolicy:
    """Which per-token tensors of a model the tensor prefix cache keeps.

    - ``full_prefix_hidden``: a downstream stage reads one ``[tokens, hidden_size]``
      tensor for *every* token of the sequence, prefix included. The stage computes
      it each step, the cache stores it in its hidden-state slot, and on a KV
      prefix hit the skipped prefix rows are served from the cache.
    - ``deferred_keys``: per-token outputs known only after sampling. The model
      computes them in ``deferred_outputs(step, hidden, runner_output) ->
      {key: [tokens, ...] tensor}``. They are staged per request, written to the
      cache when the request finishes, and discarded when it is aborted or
      preempted. They are kept for later hits; no merge reads them yet.

    A model that declares neither (the default, e.g. a stage that reads only the
    last row, or nothing) gets no tensor cache at all: no allocation, no per-step
    copy, no merge. The cache would cost memory and time and buy nothing there.
    """

    full_prefix_hidden: bool = False
    deferred_keys: frozenset[str] = field(default_factory=frozenset)

    @property
    def caches_anything(self) -> bool:
        return self.full_prefix_hidden or bool(self.deferred_keys)


NO_TENSOR_CACHE = TensorCachePolicy()


def tensor_cache_policy_of(model: Any) -> TensorCachePolicy:
    """The policy a model declares (attribute ``tensor_cache_policy``); none by default."""
    policy = getattr(model, "tensor_cache_policy", None)
    if policy is None:
        return NO_TENSOR_CACHE
    if not isinstance(policy, TensorCachePolicy):
        raise TypeError(
            f"{type(model).__name__}.tensor_cache_policy: expected a TensorCachePolicy, got {type(policy).__name__}"
        )
    return policy
