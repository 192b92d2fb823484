"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """Limits of one engine step and of the KV pool.

    ``max_num_batched_tokens`` is the per-step token budget shared by decodes
    and prefill chunks; a prompt longer than it is prefilled over several
    steps. ``long_prefill_token_threshold`` (0: no cap) additionally caps the
    tokens one request may take in a step, so one long prompt cannot crowd
    out the other prefills.
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 1024
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")
        t = self.long_prefill_token_threshold
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"SchedulerConfig.long_prefill_token_threshold must be an integer >= 0, got {t!r}")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size
