"""Every environment variable omnistage reads, in one place.

Policy: a variable is read each time its function is called, never cached at
import, so a test (``monkeypatch.setenv``) or a long-lived process sees the
value in force when the switch matters (most are read when a model loads).
A malformed value raises ``ValueError`` naming the variable and what it
expected. Modules never read ``os.environ`` themselves; they call these.

- ``OMNISTAGE_CACHE_DIR`` (default ``~/.cache/omnistage``): where converted
  GGUF checkpoints and the built native kernels are kept.
- ``OMNISTAGE_NATIVE`` (on): ``0`` turns the native CPU kernels off (torch ops
  instead).
- ``CXX`` (``g++``): the compiler the native kernels are built with.
- ``OMNISTAGE_LEAN_FORWARD`` (on): ``0`` runs HF's modules instead of the lean
  decoder (read when a model is wrapped).
- ``OMNISTAGE_PREPACK`` (on): ``0`` keeps no oneDNN-prepacked weight copies.
- ``OMNISTAGE_PREPACK_MAX_BYTES`` (``2 << 30``, 2 GiB): the most bytes of
  prepacked copies; a model that would need more gets none.
- ``OMNISTAGE_DENSE_DECODE_BYTES`` (``1 << 30``, 1 GiB): byte budget of the
  dense decode views over all layers; ``0`` turns them off.
- ``OMNISTAGE_MEASURE_STEP_COST`` (on): ``0`` keeps the draft policy's built-in
  step-cost curve instead of measuring this machine's when a speculating
  engine starts (``worker/step_costs.py``): the same drafts on every machine
  and run, for tests and for seeded sampling that must repeat across runs.
- ``RAY_ADDRESS`` (unset): the Ray cluster that encoder workers
  (``num_encoder_workers``) and data-parallel replicas (``data_parallel_size``)
  run on; unset starts a local instance.

A switch is off for ``0``, ``false``, ``no`` or ``off`` (any case); any other
value, or none, leaves it on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE_DIR",
    "CXX",
    "DENSE_DECODE_BYTES",
    "LEAN_FORWARD",
    "MEASURE_STEP_COST",
    "NATIVE",
    "PREPACK",
    "PREPACK_MAX_BYTES",
    "RAY_ADDRESS",
    "VARIABLES",
    "EnvVar",
    "cache_dir",
    "cxx",
    "dense_decode_bytes",
    "lean_forward_enabled",
    "measure_step_cost_enabled",
    "native_enabled",
    "prepack_enabled",
    "prepack_max_bytes",
    "ray_address",
]

_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, its default (as the text it would hold) and what it means."""

    name: str
    default: str
    meaning: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)

    def flag(self) -> bool:
        return self.raw().strip().lower() not in _OFF

    def byte_count(self) -> int:
        text = self.raw().strip()
        try:
            value = int(text, 0)  # 0: "1073741824", "0x40000000" and "1_073_741_824" all parse
        except ValueError:
            raise ValueError(f"{self.name}={text!r}: expected a whole number of bytes (0 or more)") from None
        if value < 0:
            raise ValueError(f"{self.name}={text!r}: expected a whole number of bytes (0 or more)")
        return value


CACHE_DIR = EnvVar("OMNISTAGE_CACHE_DIR", "", "folder for converted checkpoints and built kernels")
NATIVE = EnvVar("OMNISTAGE_NATIVE", "1", "0 turns the native CPU kernels off")
CXX = EnvVar("CXX", "g++", "compiler the native kernels are built with")
LEAN_FORWARD = EnvVar("OMNISTAGE_LEAN_FORWARD", "1", "0 runs HF's modules instead of the lean decoder")
PREPACK = EnvVar("OMNISTAGE_PREPACK", "1", "0 keeps no oneDNN-prepacked weight copies")
PREPACK_MAX_BYTES = EnvVar("OMNISTAGE_PREPACK_MAX_BYTES", str(2 << 30), "most bytes of prepacked weight copies")
DENSE_DECODE_BYTES = EnvVar(
    "OMNISTAGE_DENSE_DECODE_BYTES", str(1 << 30), "byte budget of the dense decode views (0: off)"
)
MEASURE_STEP_COST = EnvVar(
    "OMNISTAGE_MEASURE_STEP_COST", "1", "0 keeps the built-in step-cost curve of the draft policy"
)

RAY_ADDRESS = EnvVar("RAY_ADDRESS", "", "the Ray cluster to use (unset: start a local instance)")

VARIABLES: tuple[EnvVar, ...] = (
    CACHE_DIR, NATIVE, CXX, LEAN_FORWARD, PREPACK, PREPACK_MAX_BYTES, DENSE_DECODE_BYTES, MEASURE_STEP_COST,
    RAY_ADDRESS,
)  # fmt: skip


def cache_dir() -> Path:
    """``$OMNISTAGE_CACHE_DIR`` (``~`` expanded) or ``~/.cache/omnistage``."""
    text = CACHE_DIR.raw()
    return Path(text).expanduser() if text else Path.home() / ".cache" / "omnistage"


def native_enabled() -> bool:
    return NATIVE.flag()


def cxx() -> str:
    return CXX.raw()


def lean_forward_enabled() -> bool:
    return LEAN_FORWARD.flag()


def prepack_enabled() -> bool:
    return PREPACK.flag()


def prepack_max_bytes() -> int:
    return PREPACK_MAX_BYTES.byte_count()


def dense_decode_bytes() -> int:
    return DENSE_DECODE_BYTES.byte_count()


def measure_step_cost_enabled() -> bool:
    return MEASURE_STEP_COST.flag()


def ray_address() -> str:
    """``$RAY_ADDRESS``, or ``"local"`` (start a local Ray instance) when unset:
    never a cluster found by chance on the machine."""
    return RAY_ADDRESS.raw().strip() or "local"
