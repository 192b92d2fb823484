"""An EAGLE-1 draft head, loaded from the checkpoint layout vLLM reads for Llama / Qwen2 targets.

The head is one decoder layer over ``fc(concat(embedding of the next token,
target's final hidden state))``; its output goes through the *target's* LM
head (no final norm of its own), and it embeds tokens with the *target's*
embedding table. So a head folder holds only:

- ``config.json`` of a Llama / Qwen2 / Qwen3 decoder (``architectures`` such
  as ``EagleLlamaForCausalLM`` or ``LlamaForCausalLMEagle``;
  ``model_type`` picks the layer class), with the target's ``hidden_size``;
- weights (``*.safetensors`` or ``pytorch_model.bin``) named ``fc.weight``
  (``[hidden, 2 * hidden]``, optional ``fc.bias``) and ``layers.0.*``, with or
  without a ``model.`` prefix. ``layers.0.input_layernorm`` is usually absent
  (EAGLE-1 feeds ``fc``'s output to attention unnormalized) and is then the
  identity. ``embed_tokens`` / ``lm_head`` in the file are ignored: the
  target's are shared, as vLLM shares them.

The layer runs on omnistage's paged attention (its KV cache is the
drafter's, one layer, addressed through the target's block tables), with
plain 1-D RoPE over sequence positions, also for an M-RoPE target. It runs
as the target's lean decoder runs its layers (``fast_forward.lean_layer``:
fused, prepacked matmuls and native elementwise calls), since the head is on
the critical path of every drafting step: HF's module cost 2.5 ms for a
one-token step of SmolLM2's width on a 2-core CPU, about 40% of the whole
target's decode step. Where no lean form applies, HF's module runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from omnistage.attention.paged_attention import (
    ATTN_IMPL,
    AttentionMetadata,
    attention_context,
)
from omnistage.kernels.group_int8 import quantize_q8_0
from omnistage.models.fast_forward import (
    LeanLayer,
    PackedLinear,
    layer_forward,
    lean_layer,
    lean_linear,
    linear_groups,
    rope_tables,
    uses_native_ops,
)

__all__ = ["EAGLE_ARCHITECTURES", "EagleHead", "load_eagle_head"]

# Architecture names EAGLE-1 heads carry (vLLM's, and the original EAGLE repository's plain ones).
EAGLE_ARCHITECTURES = frozenset({
    "EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "EAGLEModel",
    "EagleQwen2ForCausalLM", "Qwen2ForCausalLMEagle", "EagleQwen3ForCausalLM", "Qwen3ForCausalLMEagle",
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
})  # fmt: skip


def _layer_classes(model_type: str) -> tuple[type, type]:
    """(decoder layer, rotary embedding) classes of a model type."""
    if model_type == "llama":
        from transformers.models.llama import modeling_llama as m

        return m.LlamaDecoderLayer, m.LlamaRotaryEmbedding
    if model_type == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m

        return m.Qwen2DecoderLayer, m.Qwen2RotaryEmbedding
    if model_type == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m

        return m.Qwen3DecoderLayer, m.Qwen3RotaryEmbedding
    raise ValueError(
        f"model_type {model_type!r} is not an EAGLE head layer omnistage runs; expected llama, qwen2, qwen3"
    )


@dataclasses.dataclass(frozen=True)
class LeanHead:
    """What a head runs when it runs lean: ``fc`` and the layer in the lean decoder's form."""

    fc: PackedLinear
    layer: LeanLayer
    native: bool  # the elementwise steps as native calls (fp32 on CPU with the kernels)


class EagleHead(torch.nn.Module):
    """``fc`` + one decoder layer; ``forward`` returns the layer's output ``[T, hidden]``
    (fed to the target's LM head for logits, and back in as the next draft step's hidden state)."""

    def __init__(
        self,
        config: PretrainedConfig,
        fc: torch.nn.Linear,
        layer: torch.nn.Module,
        rotary: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.fc = fc
        self.layer = layer
        self.rotary = rotary
        self.num_layers = 1
        heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // heads
        )
        self.hidden_size = int(config.hidden_size)
        self.lean: LeanHead | None = None  # set by make_lean() once the weights have their device and dtype

    def make_lean(self, int8: bool = False) -> None:
        """Run the layer (and ``fc``) the lean way where it can: fp32 or bf16, no sliding window.

        ``int8`` (the target keeps its own weights in GGUF's group-int8 form): the
        matmul weights are rounded to ``Q8_0`` and kept only in that form, a
        quarter of fp32's bytes, which is what a head pass streams (1.7 ms of
        fp32 at SmolLM2's width on a 2-core CPU). Drafts are verified, so the
        rounding can cost acceptance, never output.
        """
        config = self.config
        if getattr(config, "use_sliding_window", False) or getattr(config, "mlp_bias", False):
            return
        if getattr(config, "hidden_act", "silu") != "silu":
            return
        native = uses_native_ops(self.fc.weight)
        q8 = int8 and native  # no oneDNN copies then: the fp32 weights are only quantized
        fc, layer = lean_linear([self.fc], not q8), lean_layer(self.layer, prepack=not q8)
        if q8:
            qkv, gate_up, o, down = linear_groups(self.layer)
            fc = _q8_0(fc, [self.fc])
            layer = dataclasses.replace(
                layer, qkv=_q8_0(layer.qkv, qkv), o=_q8_0(layer.o, o), gate_up=_q8_0(layer.gate_up, gate_up),
                down=_q8_0(layer.down, down),
            )  # fmt: skip
        self.lean = LeanHead(fc, layer, native)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @torch.inference_mode()
    def forward(  # type: ignore[override]
        self,
        inputs_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The head over a step's positions: writes its KV at every one and returns its
        output ``[T, hidden]``, or only rows ``out_rows`` (the positions a draft is read
        from; the lean layer then skips the rest's output projection and MLP)."""
        x = torch.cat((inputs_embeds.to(self.dtype), target_hidden.to(self.dtype)), dim=-1)
        if (lean := self.lean) is not None:
            h = lean.fc(x)
            cos, sin = rope_tables(self.rotary, h, positions, self.head_dim)
            return layer_forward(lean.layer, h, cos, sin, kv_caches[0], attn_metadata, lean.native, out_rows)
        h = self.fc(x)[None]
        position_ids = positions[None]
        with attention_context(attn_metadata, kv_caches):
            cos_sin = self.rotary(h, position_ids)
            out = self.layer(
                h,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=cos_sin,
            )
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return out if out_rows is None else out.index_select(0, out_rows)


def _q8_0(linear: PackedLinear, modules: list[torch.nn.Linear]) -> PackedLinear:
    """``linear`` with its weight in ``Q8_0`` (:func:`quantize_q8_0`), the HF modules' fp32
    copies released (one-element placeholders: HF's module no longer runs this head); as it
    was where that form does not apply."""
    weight = quantize_q8_0(linear.weight)
    if weight is None:
        return linear
    for m in modules:
        m.weight.data = m.weight.new_zeros(()).expand(m.weight.shape)
    return PackedLinear.from_int8(weight, linear.bias)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            weights.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").is_file():
        weights = torch.load(
            path / "pytorch_model.bin", map_location="cpu", weights_only=True
        )
    else:
        raise ValueError(
            f"EAGLE head {str(path)!r}: no weights (*.safetensors or pytorch_model.bin)"
        )
    return {k.removeprefix("model."): v for k, v in weights.items()}


def load_eagle_head(
    path: str | Path,
    target_hidden_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    int8: bool = False,
) -> EagleHead:
    """Load the head at ``path`` for a target of ``target_hidden_size`` (``int8``: a target whose
    weights are group-int8, see :meth:`EagleHead.make_lean`); ``ValueError`` names what is wrong."""
    path = Path(path).expanduser()
    where = f"EAGLE head {str(path)!r}"
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{where}: expected a folder with config.json and the head's weights"
        )
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where}: config.json is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: config.json must hold a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if archs and not set(archs) & EAGLE_ARCHITECTURES:
        raise ValueError(f"{where}: architectures {archs} is not an EAGLE-1 head; expected one of "
                         f"{sorted(EAGLE_ARCHITECTURES)}")  # fmt: skip
    config = AutoConfig.from_pretrained(path)
    layer_cls, rotary_cls = _layer_classes(getattr(config, "model_type", ""))
    if int(config.hidden_size) != target_hidden_size:
        raise ValueError(
            f"{where}: hidden_size {config.hidden_size} differs from the target's {target_hidden_size}"
        )
    weights = _read_weights(path)
    fc_w = weights.get("fc.weight")
    hidden = target_hidden_size
    if fc_w is None or tuple(fc_w.shape) != (hidden, 2 * hidden):
        got = None if fc_w is None else tuple(fc_w.shape)
        raise ValueError(
            f"{where}: expected weight 'fc.weight' of shape {(hidden, 2 * hidden)}, got {got}"
        )
    config._attn_implementation = ATTN_IMPL
    fc = torch.nn.Linear(2 * hidden, hidden, bias="fc.bias" in weights)
    layer = layer_cls(config, layer_idx=0)
    layer_sd = {
        k.removeprefix("layers.0."): v
        for k, v in weights.items()
        if k.startswith("layers.0.")
    }
    if "input_layernorm.weight" not in layer_sd:
        layer.input_layernorm = (
            torch.nn.Identity()
        )  # EAGLE-1: fc's output goes to attention unnormalized
    try:
        missing, unexpected = layer.load_state_dict(layer_sd, strict=False)
    except RuntimeError as exc:  # shapes that config.json does not describe
        raise ValueError(f"{where}: layers.0 weights do not match config.json: {exc}") from None
    missing = [k for k in missing if not k.startswith("input_layernorm")]
    if missing or unexpected:
        raise ValueError(f"{where}: layers.0 weights do not match a {layer_cls.__name__}: "
                         f"missing {missing[:4]}, unexpected {unexpected[:4]}")  # fmt: skip
    fc.load_state_dict(
        {k.removeprefix("fc."): v for k, v in weights.items() if k.startswith("fc.")}
    )
    head = EagleHead(config, fc, layer, rotary_cls(config=config)).to(device=device, dtype=dtype).eval()
    head.make_lean(int8)
    return head
