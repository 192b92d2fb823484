"""Engine arguments and how they resolve against a loaded model."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

DEFAULT_MAX_MODEL_LEN_CAP = 8192
DEFAULT_KV_CACHE_BYTES_CPU = 512 * 1024**2
DEFAULT_KV_CACHE_BYTES_GPU = 4 * 1024**3


@dataclass
class EngineArgs:
    """Everything needed to build an ``LLMEngine``.

    ``num_kv_blocks`` wins over ``kv_cache_memory_bytes``; with neither, the
    KV pool gets a default byte budget (512 MiB on CPU, 4 GiB on an
    accelerator), never more than ``max_num_seqs`` full-length requests need.
    ``max_model_len=None`` takes the model's context length, capped at 8192.

    Multimodal models: ``encoder_cache_size`` (encoder embeddings held) and
    ``max_num_batched_encoder_embeds`` (embeddings encoded per step) default
    to ``max_num_batched_tokens`` and are raised to the largest item the model
    accepts. ``enable_encoder_cache=False`` keeps no encoder output beyond its
    last user (no reuse across requests).
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    encoder_cache_size: int | None = None
    max_num_batched_encoder_embeds: int | None = None
    enable_encoder_cache: bool = True

    def __post_init__(self) -> None:
        checks = [
            ("block_size", self.block_size >= 1),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1),
            ("max_num_seqs", self.max_num_seqs >= 1),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1),
            ("kv_cache_memory_bytes", self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 1),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2),
            ("encoder_cache_size", self.encoder_cache_size is None or self.encoder_cache_size >= 1),
            (
                "max_num_batched_encoder_embeds",
                self.max_num_batched_encoder_embeds is None or self.max_num_batched_encoder_embeds >= 1,
            ),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"EngineArgs.{name} is out of range: {getattr(self, name)!r}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Fields from flags of the same name (``--block-size`` -> ``block_size``);
        unset (None) flags keep the defaults and ``--no-prefix-caching`` turns caching off."""
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        if getattr(args, "no_prefix_caching", False):
            kwargs["enable_prefix_caching"] = False
        if getattr(args, "no_encoder_cache", False):
            kwargs["enable_encoder_cache"] = False
        return cls(**kwargs)

    def resolve_max_model_len(self, model_max_len: int | None) -> int:
        limit = model_max_len or DEFAULT_MAX_MODEL_LEN_CAP
        if self.max_model_len is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
        if self.max_model_len > limit:
            raise ValueError(
                f"EngineArgs.max_model_len={self.max_model_len} exceeds the model's context length {limit}"
            )
        return self.max_model_len

    def resolve_num_kv_blocks(self, bytes_per_block: int, max_model_len: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_memory_bytes
        if budget is None:
            budget = DEFAULT_KV_CACHE_BYTES_CPU if self.device == "cpu" else DEFAULT_KV_CACHE_BYTES_GPU
        blocks_per_seq = -(-max_model_len // self.block_size)
        num_blocks = min(budget // bytes_per_block, self.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes holds no block of {bytes_per_block} bytes; raise kv_cache_memory_bytes"
            )
        return int(num_blocks)
