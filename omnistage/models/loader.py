"""Load a causal LM, its tokenizer and its stop tokens from a local checkpoint.

Accepted sources: a checkpoint folder (config.json, safetensors weights,
tokenizer files), a ``.gguf`` file (converted once to a cached folder), or
``None`` for the embedded default model. Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.utils import logging as hf_logging

from omnistage.models.adapter import CausalLM
from omnistage.models.default_model import DEFAULT_MODEL_NAME, default_gguf_path, default_model_path
from omnistage.models.gguf_convert import cached_gguf_checkpoint
from omnistage.models.mm_loader import MM_MODEL_TYPES, load_multimodal, mm_text_config

# Model types whose HF attention goes through AttentionInterface with full
# (non-sliding) causal attention, checked against HF's own forward in tests.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class LoadedModel:
    """A model ready for the engine, with what the engine needs to drive it."""

    model: CausalLM
    tokenizer: object  # a transformers tokenizer (PreTrainedTokenizerBase)
    hf_config: PretrainedConfig
    eos_token_ids: list[int]
    max_model_len: int
    model_path: str
    name: str
    # Multimodal checkpoints: the adapter (towers, M-RoPE) over the HF model;
    # ``model`` then runs its language model. None for text-only models.
    mm_adapter: object | None = None


@contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """Silence HF's per-load progress bars (an engine loads on every start), then restore them."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def checkpoint_config(model: str | Path | None) -> dict | None:
    """A checkpoint folder's ``config.json`` as a dict; None when ``model`` is not
    a folder with a readable one (for the checks that pick a loader)."""
    if model is None:
        return None
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError):
        return None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or a torch.dtype") from None


def resolve_model_path(model: str | Path | None) -> tuple[Path, str]:
    """``(checkpoint folder, display name)`` for a folder, a ``.gguf`` file or ``None``."""
    if model is None:
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist; expected a local checkpoint folder "
            "(config.json, *.safetensors, tokenizer files) or a .gguf file"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or a checkpoint folder")
        name = DEFAULT_MODEL_NAME if path.resolve() == _default_gguf_or_none() else path.stem
        return cached_gguf_checkpoint(path), name
    _check_folder(path)
    return path, path.resolve().name


def _default_gguf_or_none() -> Path | None:
    try:
        return default_gguf_path().resolve()
    except FileNotFoundError:
        return None


def _check_folder(path: Path) -> None:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("model weights (*.safetensors)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(_TOKENIZER_FILES)})")
    if missing:
        raise ValueError(f"checkpoint folder {str(path)!r} lacks {', '.join(missing)}")


def check_supported(config: PretrainedConfig, path: Path) -> None:
    """Raise ``ValueError`` unless paged attention reproduces this model exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in MM_MODEL_TYPES:
        raise ValueError(
            f"{str(path)!r}: architecture {getattr(config, 'architectures', None)} (model_type {model_type!r}) "
            f"is not supported; omnistage runs model types {list(SUPPORTED_MODEL_TYPES + MM_MODEL_TYPES)}"
        )
    if model_type in MM_MODEL_TYPES:
        config = mm_text_config(config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type == "longrope":
        # Its factors follow the longest position in one rotary call, which a packed batch of
        # requests shares: a request's rotation would depend on the others beside it.
        raise ValueError(f"{str(path)!r}: rope_type 'longrope' is not supported yet")
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{str(path)!r}: sliding-window attention is not supported by omnistage's paged attention "
            f"(use_sliding_window={getattr(config, 'use_sliding_window', None)}, layer_types={set(layer_types)})"
        )


def eos_token_ids(path: Path, config: PretrainedConfig, tokenizer: object) -> list[int]:
    """Stop ids from generation_config.json, then config.json, then the tokenizer, deduplicated."""
    ids: list[int] = []
    sources: list[object] = []
    if (path / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(path).eos_token_id)
    sources.append(getattr(config, "eos_token_id", None))
    sources.append(getattr(tokenizer, "eos_token_id", None))
    for source in sources:
        for token_id in source if isinstance(source, (list, tuple)) else [source]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def load_model(
    model: str | Path | None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load ``model`` (folder, ``.gguf`` file or ``None`` = default) for omnistage."""
    torch_dtype = resolve_dtype(dtype)
    path, name = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{str(path)!r}: cannot read config.json ({exc})") from exc
    check_supported(config, path)
    mm_adapter = None
    with hf_progress_bars_off():
        if config.model_type in MM_MODEL_TYPES:
            causal_lm, mm_adapter = load_multimodal(path, config, torch_dtype, device)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
            hf_model.to(device)
            causal_lm = CausalLM(hf_model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text_config = mm_text_config(config) if mm_adapter is not None else config.get_text_config()
    max_len = getattr(text_config, "max_position_embeddings", None) or getattr(tokenizer, "model_max_length", 2048)
    return LoadedModel(
        model=causal_lm,
        tokenizer=tokenizer,
        hf_config=config,
        eos_token_ids=eos_token_ids(path, config, tokenizer),
        max_model_len=int(max_len),
        model_path=str(path),
        name=name,
        mm_adapter=mm_adapter,
    )
