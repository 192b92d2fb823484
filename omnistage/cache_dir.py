"""Where omnistage keeps what it builds once per machine (converted checkpoints, native kernels)."""

from __future__ import annotations

from pathlib import Path

from omnistage import envs

__all__ = ["cache_root"]


def cache_root() -> Path:
    """``$OMNISTAGE_CACHE_DIR`` or ``~/.cache/omnistage``."""
    return envs.cache_dir()
