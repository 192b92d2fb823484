"""Sampling parameters, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    Validation runs at construction: a bad value raises ``ValueError`` naming
    the field, what was expected and what came, before the request reaches
    the engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("n", self.n >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0.0, "a float >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "a float in (0, 1]"),
            ("top_k", self.top_k >= 0, "0, -1 (disabled) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "a float in [0, 1]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "None or an integer >= 1"),
            ("min_tokens", self.min_tokens >= 0, "an integer >= 0"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "None or an integer >= 0"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {expected}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must hold non-empty strings, got an empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
