"""A lean decoder forward for Llama, Qwen2 and Qwen3, over the HF modules' own weights.

The HF modeling path costs a few dozen small ops and several Python module
calls per layer (decorators, kwargs plumbing, one attention-interface
lookup); at batch 1 that overhead is about as large as the weight-bandwidth
bound math. :class:`LeanDecoder` runs the same math with fewer ops:

- q/k/v and gate/up projections fused into one matmul each. The fused
  weights are concatenated once, and the HF ``Linear`` parameters are then
  made views into them, so memory does not grow and the HF path (still used
  by anything that calls the HF model) reads the very same numbers;
- fp32 on CPU: every matmul weight (and a tied embedding / LM head) is
  stored transposed, ``[in, out]`` contiguous, and used through its
  ``[out, in]`` view: MKL's kernels for that layout read the weight
  measurably faster when it streams from memory (batch-1 gemv 1.3-1.6x on
  the q/k/v, gate/up and LM-head shapes of SmolLM2, batched decode
  1.1-1.5x); for 4+ rows (batched decode, prefill) the gate/up and LM-head
  matmuls use a oneDNN-prepacked copy of the weight (:class:`PackedLinear`);
- fp32 on CPU with the native kernels (:mod:`omnistage.kernels`):
  weights loaded from a ``Q4_1`` / ``Q8_0`` GGUF file (the embedded
  default model) multiply, up to ``INT8_MAX_ROWS`` rows (decode steps), on
  the group-int8 kernel, which rebuilds exactly the same fp32 weights from
  1.25 bytes each instead of streaming 4; RMSNorm, RoPE and SiLU-times-up
  are one native call each instead of two to six torch ops, and decode
  attention one pass per KV head and sequence;
- bf16 on CPU: weights keep their layout and every matmul, from one row
  up, uses a oneDNN-prepacked copy, which runs on the AMX / AVX512-BF16
  units (1.3-2x over ``F.linear`` on SmolLM2's shapes at 1 and 32 rows);
- RoPE once for q and k together, with the rotation's sign folded into a
  precomputed ``sin`` (bit-identical to HF's ``rotate_half``); cos/sin come
  from the model's own rotary module once per step, for all layers;
- Qwen3's per-head q/k RMSNorm as one op over q and k together;
- paged attention called directly (:func:`omnistage.attention.paged_attention.paged_attention`).

On the torch path every elementwise op is the one HF uses, in the same
order, so in fp32 the only differences from the HF path are the matmuls'
summation orders. The native calls add two more: the order in which
RMSNorm and softmax sum, and the rounding of their own ``exp`` (SiLU,
softmax); RoPE stays bit-identical.

Only the exact HF classes listed in :data:`LEAN_MODEL_CLASSES` qualify
(checked per layer); anything else keeps the HF modeling path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from omnistage import envs
from omnistage.kernels.decode_ops import native_rms_norm, native_rope, native_silu_mul
from omnistage.kernels.group_int8 import encode_group_int8, group_int8_matmul
from omnistage.kernels.native import native_kernels
from omnistage.attention.paged_attention import AttentionMetadata, paged_attention

__all__ = ["LEAN_MODEL_CLASSES", "LeanDecoder", "PackedLinear", "lean_decoder_or_none"]

PREPACK_ENV = envs.PREPACK.name  # "0" turns oneDNN weight prepacking off
PREPACK_MAX_BYTES_ENV = envs.PREPACK_MAX_BYTES.name
# Prepacking keeps a second copy of the weights it packs; above OMNISTAGE_PREPACK_MAX_BYTES of
# copies (default in omnistage.envs) the memory is not worth it.
# Rows for which the prepacked matmul wins in fp32: below the minimum (batch-1 decode) MKL's gemv
# on the plain weight is faster, above the maximum (long prefill chunks) MKL's own packing pays off.
# In bf16 oneDNN's kernels win at every size.
PREPACK_MIN_ROWS = 4
PREPACK_MAX_ROWS = 512
# Rows up to which the group-int8 kernel beats the fp32 ones (measured crossover 64-96 rows).
INT8_MAX_ROWS = 64

# model class -> (decoder layer class, attention class) names it must be made of.
LEAN_MODEL_CLASSES = {
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"),
    "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP"),
    "Qwen3ForCausalLM": ("Qwen3DecoderLayer", "Qwen3Attention", "Qwen3MLP"),
}


class PackedLinear:
    """``F.linear`` with an optional oneDNN-prepacked copy of the weight.

    fp32: MKL's sgemm re-packs the weight on every call; for the 8-64 row
    matmuls of batched decode that packing is a large part of the cost, and
    a weight reordered once into oneDNN's blocked layout was measured
    1.2-1.5x faster there on the big gate/up and LM-head shapes (not on the
    small q/k/v, o and down ones). Single rows keep MKL's gemv on the plain
    weight, and so do long prefill chunks, where MKL was as fast or faster.
    bf16: the packed weight serves every input size.

    With ``int8`` (fp32 on CPU) the weight's exact group-int8 form is
    looked for, and when found serves every input of up to
    ``INT8_MAX_ROWS`` rows (above that the fp32 kernels are faster).
    """

    __slots__ = ("weight", "bias", "packed", "min_rows", "max_rows", "int8")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool, int8: bool = False) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.int8 = encode_group_int8(self.weight) if int8 else None
        self.packed = None
        if prepack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)
        reduced = self.weight.dtype != torch.float32
        self.min_rows = 1 if reduced else PREPACK_MIN_ROWS
        self.max_rows = 1 << 62 if reduced else PREPACK_MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None and x.shape[0] <= INT8_MAX_ROWS:
            y = group_int8_matmul(x, self.int8)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed is not None and self.min_rows <= x.shape[0] <= self.max_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepack_enabled(weights: Sequence[torch.Tensor]) -> bool:
    """Whether to keep oneDNN-prepacked copies of ``weights`` (CPU, fp32/bf16, their size, env)."""
    if not envs.prepack_enabled():
        return False
    if not weights or not torch.backends.mkldnn.is_available():
        return False
    w = weights[0]
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return False
    if w.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    limit = envs.prepack_max_bytes()
    return sum(t.numel() * t.element_size() for t in weights) <= limit


@dataclass
class _Layer:
    in_norm: torch.Tensor
    in_eps: float
    qkv: PackedLinear
    qk_norm: torch.Tensor | None  # [H + Hkv, D] (Qwen3), None otherwise
    qk_eps: float
    o: PackedLinear
    post_norm: torch.Tensor
    post_eps: float
    gate_up: PackedLinear
    down: PackedLinear
    scaling: float


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``*RMSNorm`` op for op (fp32 statistics), with in-place temporaries.

    Bit-identical to HF's module (tests/models/test_fast_forward.py). The fused
    ``F.rms_norm`` is no faster at decode sizes and 1.4-2.8x slower on prefill.
    """
    dtype = x.dtype
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * var.add_(eps).rsqrt_()
    return weight * normed.to(dtype)


def _fuse(linears: Sequence[torch.nn.Linear], transpose: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[sum(out), in]`` weight (and bias) for ``linears``; their parameters become views of it.

    With ``transpose`` the storage is ``[in, sum(out)]`` contiguous and the
    returned weight (like each parameter) a transposed view of it.
    """
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight.detach()
        weight = weight.t().contiguous().t() if transpose else weight.contiguous()
        has_bias = [m.bias is not None for m in linears]
        bias = None
        if any(has_bias):
            bias = torch.cat(
                [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
            ).contiguous()
        start = 0
        for m in linears:
            n = m.out_features
            m.weight.data = weight[start : start + n]
            if m.bias is not None:
                m.bias.data = bias[start : start + n]
            start += n
    return weight, bias


def lean_decoder_or_none(hf_model: PreTrainedModel) -> LeanDecoder | None:
    """A :class:`LeanDecoder` for ``hf_model`` when it is exactly a supported HF class, else ``None``."""
    names = LEAN_MODEL_CLASSES.get(type(hf_model).__name__)
    if names is None:
        return None
    base = getattr(hf_model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or getattr(base, "rotary_emb", None) is None:
        return None
    config = hf_model.config
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return None
    if getattr(config, "use_sliding_window", False):
        return None
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return None
    for layer in layers:
        if (type(layer).__name__, type(layer.self_attn).__name__, type(layer.mlp).__name__) != names:
            return None
    return LeanDecoder(hf_model)


class LeanDecoder:
    """The decoder stack of a Llama/Qwen2/Qwen3 ``*ForCausalLM``, lean (see the module doc).

    Build it after the model has been moved to its device and dtype: the
    fused weights are shared with the HF parameters as views, and a later
    ``.to()`` would split them.
    """

    def __init__(self, hf_model: PreTrainedModel) -> None:
        base = hf_model.model
        config = hf_model.config
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.final_norm = base.norm.weight
        self.final_eps = float(base.norm.variance_epsilon)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.layers: list[_Layer] = []
        cpu = self.embed.weight.device.type == "cpu"
        transpose = cpu and self.embed.weight.dtype == torch.float32
        lm_head = hf_model.get_output_embeddings()
        fused = [
            (
                _fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], transpose),
                _fuse([layer.mlp.gate_proj, layer.mlp.up_proj], transpose),
                _fuse([layer.self_attn.o_proj], transpose),
                _fuse([layer.mlp.down_proj], transpose),
            )
            for layer in base.layers
        ]
        # A tied LM head is the embedding itself: transposing it slows only the embedding
        # lookup (a strided row gather, ~30 ms for a 2,048-token step of SmolLM2).
        lm_w, lm_b = _fuse([lm_head], transpose)
        # fp32 prepacks the gate/up and LM-head weights, where oneDNN beats MKL; bf16 prepacks all.
        prepack_all = not transpose
        packed = [w for ws in fused for w, _ in ws] if prepack_all else [gate_up for _, (gate_up, _), _, _ in fused]
        self.prepack = prepack_enabled(packed + [lm_w])
        pack_rest = self.prepack and prepack_all  # q/k/v, o and down
        # fp32 on CPU: weights with an exact group-int8 form decode on the native kernel, and the
        # elementwise steps run as native calls.
        int8 = self.native_ops = transpose and native_kernels() is not None
        self.lm_head = PackedLinear(lm_w, lm_b, self.prepack, int8)
        for layer, ((w_qkv, b_qkv), (w_gu, _), (w_o, b_o), (w_down, b_down)) in zip(base.layers, fused):
            attn = layer.self_attn
            self.head_dim = int(attn.head_dim)
            qk_norm, qk_eps = None, 0.0
            if hasattr(attn, "q_norm"):
                qk_norm = torch.cat(
                    [
                        attn.q_norm.weight.detach().expand(self.num_heads, -1),
                        attn.k_norm.weight.detach().expand(self.num_kv_heads, -1),
                    ]
                ).contiguous()
                qk_eps = float(attn.q_norm.variance_epsilon)
                if float(attn.k_norm.variance_epsilon) != qk_eps:
                    raise ValueError("LeanDecoder: q_norm and k_norm epsilons differ")
            self.layers.append(
                _Layer(
                    in_norm=layer.input_layernorm.weight.detach(),
                    in_eps=float(layer.input_layernorm.variance_epsilon),
                    qkv=PackedLinear(w_qkv, b_qkv, pack_rest, int8),
                    qk_norm=qk_norm,
                    qk_eps=qk_eps,
                    o=PackedLinear(w_o, b_o, pack_rest, int8),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    post_eps=float(layer.post_attention_layernorm.variance_epsilon),
                    gate_up=PackedLinear(w_gu, None, self.prepack, int8),
                    down=PackedLinear(w_down, b_down, pack_rest, int8),
                    scaling=float(attn.scaling),
                )
            )
        self.intermediate = int(self.layers[0].gate_up.weight.shape[0] // 2)

    def rope_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and sign-folded ``sin``, ``[T, 1, D]`` each, from the model's rotary module.

        ``rotate_half(x) * sin == roll(x, D/2) * cat(-sin1, sin2)`` exactly
        (negation commutes with rounding), so RoPE becomes one roll, two
        multiplies and an add on q and k together.
        """
        cos, sin = self.rotary(hidden, positions[None])  # [1, T, D]
        half = self.head_dim // 2
        sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        return cos[0, :, None], sin[:, None]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        t = h.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        nqk = nh + nkv
        half = d // 2
        inter = self.intermediate
        cos, sin = self.rope_tables(h, positions)
        native = self.native_ops
        norm = native_rms_norm if native else _rms_norm
        native_rope_ok = native and d % 32 == 0
        for layer, cache in zip(self.layers, kv_caches):
            x = norm(h, layer.in_norm, layer.in_eps)
            qkv = layer.qkv(x)
            qk = qkv[:, : nqk * d].view(t, nqk, d)
            if layer.qk_norm is not None:
                qk = _rms_norm(qk, layer.qk_norm, layer.qk_eps)
            if native_rope_ok:
                qk = native_rope(qk, cos, sin)
            else:
                qk = qk * cos + torch.roll(qk, half, -1) * sin
            v = qkv[:, nqk * d :].view(t, nkv, d)
            attn = paged_attention(
                qk[:, :nh].transpose(0, 1), qk[:, nh:].transpose(0, 1), v.transpose(0, 1), cache, md, layer.scaling
            )
            h = h + layer.o(attn.reshape(t, nh * d))
            x = norm(h, layer.post_norm, layer.post_eps)
            gu = layer.gate_up(x)
            act = native_silu_mul(gu) if native else F.silu(gu[:, :inter]) * gu[:, inter:]
            h = h + layer.down(act)
        return norm(h, self.final_norm, self.final_eps)
