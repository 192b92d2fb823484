"""Tiny real checkpoints for tests and benchmarks, built locally.

Each checkpoint is a genuine ``save_pretrained`` folder of a real
``transformers`` architecture (config.json, model.safetensors,
generation_config.json, tokenizer.json + tokenizer_config.json with a chat
template), so tests go through the same loading code as real models. The
tokenizer is a byte-level BPE trained in code on a fixed text, so it can
encode any string and needs no download.

Weights are drawn from a fixed-seed generator and scaled up from HF's usual
``0.02`` so the logits of a 64-wide model are spread out: greedy argmax is
then not near-tied, and two correct implementations pick the same token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from omnistage.models.loader import hf_progress_bars_off

TINY_ARCHS = ("llama", "qwen2", "qwen3")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. hello world! "
    "a small model reads a short prompt and writes a short answer. "
    "what is the capital of france? paris is the capital of france. "
    "one two three four five six seven eight nine ten. "
    "user assistant system: you are a helpful assistant. "
    "images, audio and video go in; text and speech come out. "
    "def main(): return 0  # code, numbers 0123456789 and punctuation ,.;:!?()[]{}"
)

_VOCAB_SIZE = 384
_WEIGHT_STD = 0.25  # vs HF's 0.02: spreads the logits so greedy choices are not near-tied


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over a fixed text: every string encodes, nothing is unknown."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_CORPUS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(
    arch: str, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, head_dim: int | None = None
) -> PretrainedConfig:
    """A small config of the real architecture: hidden 64, 4 heads, 2 KV heads (GQA); ``head_dim``
    overrides the architecture's head size (16 for Llama and Qwen2, 32 for Qwen3)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if arch == "llama":
        return LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False, **common)
    if arch == "qwen2":
        # Qwen2 has q/k/v biases; tied embeddings cover the tied lm_head path.
        return Qwen2Config(num_hidden_layers=3, tie_word_embeddings=True, **common)
    if arch == "qwen3":
        # head_dim 32 != hidden/heads: catches code that assumes hidden_size // num_heads.
        return Qwen3Config(num_hidden_layers=4, **{"head_dim": 32, **common}, tie_word_embeddings=False)
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHS}")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Fixed-seed weights in state-dict order, independent of HF's init code."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)  # norm gains stay near one
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(_WEIGHT_STD * noise)


def _gguf_round_trip(model: torch.nn.Module) -> None:
    """Make every weight matrix what loading a GGUF file gives: ``Q4_1`` blocks, ``Q8_0`` for embeddings.

    Uses the ``gguf`` package's own quantizer and dequantizer (the code
    ``transformers`` loads GGUF files with), so the fp32 weights are exactly
    the values a GGUF-converted checkpoint holds.
    """
    import gguf  # noqa: PLC0415  (only this option needs it)

    kinds = gguf.GGMLQuantizationType
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
                continue
            kind = kinds.Q8_0 if isinstance(module, torch.nn.Embedding) else kinds.Q4_1
            blocks = gguf.quants.quantize(weight.detach().numpy(), kind)
            weight.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(weight.shape)))


def write_tiny_checkpoint(
    arch: str, path: str | Path, seed: int = 0, gguf_weights: bool = False, head_dim: int | None = None
) -> Path:
    """Write a tiny ``arch`` checkpoint folder at ``path`` and return it.

    ``arch`` is one of ``"llama"``, ``"qwen2"``, ``"qwen3"``. The same
    ``(arch, seed, gguf_weights)`` always gives the same weights and
    tokenizer. ``gguf_weights`` rounds the weight matrices through GGUF
    quantization (see :func:`_gguf_round_trip`), as a model converted from a
    ``Q4_1`` GGUF file would have them. ``head_dim`` (e.g. 32, a size the
    native attention kernels take) overrides the architecture's head size.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHS}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = tiny_config(arch, len(tokenizer), bos_id, eos_id, tokenizer.pad_token_id, head_dim)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    if gguf_weights:
        _gguf_round_trip(model)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=[eos_id, bos_id], pad_token_id=tokenizer.pad_token_id
    )
    with hf_progress_bars_off():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
