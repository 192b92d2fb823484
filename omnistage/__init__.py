"""omnistage: a compact inference engine for omni-modal models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnistage.outputs import CompletionOutput, RequestOutput, StreamOutput
from omnistage.sampling_params import SamplingParams



def _installed_version() -> str:
    """The installed distribution's version; a source tree that was never installed says so."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omnistage")
    except PackageNotFoundError:
        return "0.0.0+source"


if TYPE_CHECKING:
    from omnistage.engine.arg_utils import EngineArgs
    from omnistage.engine.stage_engine import LLMEngine
    from omnistage.entrypoints.llm import LLM

__version__ = _installed_version()
__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamOutput"]

# Importing these pulls in torch and transformers; keep `import omnistage` light.
_LAZY = {
    "LLM": "omnistage.entrypoints.llm",
    "LLMEngine": "omnistage.engine.stage_engine",
    "EngineArgs": "omnistage.engine.arg_utils",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omnistage' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
