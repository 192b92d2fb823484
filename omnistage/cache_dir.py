"""Where omnistage keeps what it builds once per machine (converted checkpoints, native kernels)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """``$OMNISTAGE_CACHE_DIR`` or ``~/.cache/omnistage``."""
    env = os.environ.get("OMNISTAGE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "omnistage"
