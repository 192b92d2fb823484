"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.core.spec_decode import SpeculativeConfig


@dataclass
class SchedulerConfig:
    """Limits of one engine step and of the KV pool.

    ``max_num_batched_tokens`` is the per-step token budget shared by decodes
    and prefill chunks; a prompt longer than it is prefilled over several
    steps. ``long_prefill_token_threshold`` (0: no cap) additionally caps the
    tokens one request may take in a step, so one long prompt cannot crowd
    out the other prefills.

    Multimodal models also get an encoder budget, in encoder embeddings
    (output rows), both 0 for a text-only model: ``encoder_compute_budget``
    rows may be encoded per step and ``encoder_cache_size`` rows held at once.
    The engine sizes both from the largest item the model accepts
    (``compute_mm_encoder_budget``), since an item is always encoded whole.
    ``retain_encoder_outputs=False`` drops an encoder output as soon as no
    request uses it (the encoder cache "off": no reuse across requests).
    """

    max_num_seqs: int = 64  # EngineArgs.max_num_seqs is the source; a test keeps the two equal
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 1024
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    encoder_compute_budget: int = 0
    encoder_cache_size: int = 0
    retain_encoder_outputs: bool = True
    # None: no speculative decoding (the default; the step loop is then unchanged).
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")
        t = self.long_prefill_token_threshold
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"SchedulerConfig.long_prefill_token_threshold must be an integer >= 0, got {t!r}")
        for name in ("encoder_compute_budget", "encoder_cache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 0, got {value!r}")
        if (self.encoder_compute_budget == 0) != (self.encoder_cache_size == 0):
            raise ValueError(
                "SchedulerConfig: encoder_compute_budget and encoder_cache_size must both be 0 (text-only) "
                f"or both > 0, got {self.encoder_compute_budget} and {self.encoder_cache_size}"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size
