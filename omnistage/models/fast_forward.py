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
  a weight loaded from a ``Q4_1`` / ``Q8_0`` GGUF file (the embedded
  default model) is kept *only* in its exact group-int8 form, 0.625 bytes
  per weight for Q4_1's 4-bit integers (1.125 for Q8_0's) instead of 4, and
  every matmul over it, decode row or prefill tile, runs on the group-int8
  kernel, which multiplies by exactly those fp32 weights without storing
  them. The HF module's fp32 copy
  is then released (see *Weight ownership* below); a tied embedding is
  looked up from the same int8 rows. RMSNorm, RoPE and SiLU-times-up
  are one native call each instead of two to six torch ops, and decode
  attention one pass per KV head and query token. A decode or verify step
  that continues every layer's dense KV view runs all layers in one native call
  (:mod:`omnistage.kernels.decode_layers`: the same kernels in the same
  order, bit for bit, without the Python between them, which was about a
  quarter of a batch-1 step);
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

Weight ownership (memory): each matmul weight exists once, in the form its
matmul reads. Where the group-int8 form is exact, the lean decoder owns it
and the HF ``Linear`` / ``Embedding`` parameters are replaced by one-element
placeholders of the right shape; :meth:`LeanDecoder.restore_hf_weights`
(called by :class:`~omnistage.models.adapter.CausalLM` before anything runs
the HF modules: ``use_lean = False``, an M-RoPE step, ``hf_model``) rebuilds
their fp32 weights bit for bit. Elsewhere the HF parameters are views of
the lean decoder's fused weights, plus, where prepacking is on, one
oneDNN copy of the gate/up and LM-head weights (fp32) or of all (bf16).

Only the exact HF classes listed in :data:`LEAN_MODEL_CLASSES` qualify
(checked per layer); anything else keeps the HF modeling path.

One layer's forward (:func:`layer_forward`, over a :class:`LeanLayer` built by
:meth:`LeanLayer.from_hf`) serves the decoder stack's steps that do not take
the one native call, and an EAGLE head's single layer
(:func:`lean_layer`, :mod:`omnistage.models.eagle_head`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from omnistage import envs
from omnistage.kernels.decode_layers import DecodeLayerWeights, NativeDecodeLayers
from omnistage.kernels.decode_ops import native_rms_norm, native_rope, native_silu_mul
from omnistage.kernels.group_int8 import (
    GroupInt8Weight, argmax_screen_norms, encode_group_int8, group_int8_argmax, group_int8_matmul, group_int8_rows,
)  # fmt: skip
from omnistage.kernels.native import native_kernels
from omnistage.attention.paged_attention import (
    AttentionMetadata,
    continued_decode_views,
    continuing_decode_views,
    paged_attention,
)

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

    Built from a :class:`GroupInt8Weight` instead (:meth:`from_int8`), it
    holds no fp32 weight at all (``weight`` is ``None``) and every input
    runs on the group-int8 kernel.
    """

    __slots__ = ("weight", "bias", "packed", "min_rows", "max_rows", "int8")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool) -> None:
        self.weight: torch.Tensor | None = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.int8: GroupInt8Weight | None = None
        self.packed = None
        if prepack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)
        reduced = self.weight.dtype != torch.float32
        self.min_rows = 1 if reduced else PREPACK_MIN_ROWS
        self.max_rows = 1 << 62 if reduced else PREPACK_MAX_ROWS

    @classmethod
    def from_int8(cls, weight: GroupInt8Weight, bias: torch.Tensor | None) -> PackedLinear:
        """A linear that keeps only ``weight``'s group-int8 form."""
        lin = cls.__new__(cls)
        lin.weight, lin.packed, lin.int8 = None, None, weight
        lin.bias = None if bias is None else bias.detach()
        lin.min_rows, lin.max_rows = 1, 0
        return lin

    @property
    def out_features(self) -> int:
        return self.int8.out_features if self.int8 is not None else self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
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
class LeanLayer:
    """One decoder layer as :func:`layer_forward` runs it: fused linears, norm weights, head shape."""

    in_norm: torch.Tensor | None  # None: no input norm (an EAGLE-1 head's layer)
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
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf(
        cls, layer: torch.nn.Module, qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear
    ) -> LeanLayer:
        """An HF decoder layer's norms and attention settings around the given linears."""
        attn = layer.self_attn
        config = attn.config
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        qk_norm, qk_eps = None, 0.0
        if hasattr(attn, "q_norm"):
            qk_norm = torch.cat(
                [
                    attn.q_norm.weight.detach().expand(num_heads, -1),
                    attn.k_norm.weight.detach().expand(num_kv_heads, -1),
                ]
            ).contiguous()
            qk_eps = float(attn.q_norm.variance_epsilon)
            if float(attn.k_norm.variance_epsilon) != qk_eps:
                raise ValueError("LeanDecoder: q_norm and k_norm epsilons differ")
        in_norm = getattr(layer.input_layernorm, "weight", None)
        return cls(
            in_norm=None if in_norm is None else in_norm.detach(),
            in_eps=float(getattr(layer.input_layernorm, "variance_epsilon", 0.0)),
            qkv=qkv,
            qk_norm=qk_norm,
            qk_eps=qk_eps,
            o=o,
            post_norm=layer.post_attention_layernorm.weight.detach(),
            post_eps=float(layer.post_attention_layernorm.variance_epsilon),
            gate_up=gate_up,
            down=down,
            scaling=float(attn.scaling),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(attn.head_dim),
        )


def linear_groups(layer: torch.nn.Module) -> tuple[list[torch.nn.Linear], ...]:
    """A decoder layer's linears as the lean forward fuses them: q/k/v, gate/up, o, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj], [attn.o_proj], [mlp.down_proj]


def lean_linear(linears: Sequence[torch.nn.Linear], prepack: bool) -> PackedLinear:
    """``linears`` fused into one lean linear (their parameters become views of its weight),
    prepacked where asked and worth it (:func:`prepack_enabled`)."""
    weight, bias = _fuse(linears, transpose=_transposes(linears[0].weight))
    return PackedLinear(weight, bias, prepack and prepack_enabled([weight]))


def lean_layer(layer: torch.nn.Module, prepack: bool = True) -> LeanLayer:
    """One HF decoder layer (an EAGLE head's) in the lean form: its linears fused in place
    (no memory added), prepacked as the decoder's are (bf16: all; fp32: gate/up) unless
    ``prepack`` is off (weights about to take another form)."""
    qkv, gate_up, o, down = linear_groups(layer)
    rest = prepack and qkv[0].weight.dtype != torch.float32
    return LeanLayer.from_hf(
        layer, lean_linear(qkv, rest), lean_linear(o, rest), lean_linear(gate_up, prepack), lean_linear(down, rest)
    )


def _transposes(weight: torch.Tensor) -> bool:
    """fp32 on CPU stores matmul weights ``[in, out]`` contiguous (see the module doc)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def uses_native_ops(weight: torch.Tensor) -> bool:
    """Whether the elementwise steps of a layer with this weight run as native calls (fp32 on CPU)."""
    return _transposes(weight) and native_kernels() is not None


def rope_tables(
    rotary: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and sign-folded ``sin``, ``[T, 1, D]`` each, from an HF rotary module.

    ``rotate_half(x) * sin == roll(x, D/2) * cat(-sin1, sin2)`` exactly
    (negation commutes with rounding), so RoPE becomes one roll, two
    multiplies and an add on q and k together.
    """
    cos, sin = rotary(hidden, positions[None])  # [1, T, D]
    half = head_dim // 2
    sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
    return cos[0, :, None], sin[:, None]


def layer_forward(
    layer: LeanLayer,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    md: AttentionMetadata,
    native: bool,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decoder layer over ``h`` ``[T, hidden]`` (paged attention on ``cache``): the new ``h``,
    or only its rows ``out_rows`` (every token's keys/values are still written; the rows
    not asked for skip the output projection and the MLP, most of a layer's work)."""
    t = h.shape[0]
    nh, nkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    nqk = nh + nkv
    norm = native_rms_norm if native else _rms_norm
    x = h if layer.in_norm is None else norm(h, layer.in_norm, layer.in_eps)
    qkv = layer.qkv(x)
    qk = qkv[:, : nqk * d].view(t, nqk, d)
    if layer.qk_norm is not None:
        qk = _rms_norm(qk, layer.qk_norm, layer.qk_eps)
    if native and d % 32 == 0:
        qk = native_rope(qk, cos, sin)
    else:
        qk = qk * cos + torch.roll(qk, d // 2, -1) * sin
    v = qkv[:, nqk * d :].view(t, nkv, d)
    attn = paged_attention(
        qk[:, :nh].transpose(0, 1), qk[:, nh:].transpose(0, 1), v.transpose(0, 1), cache, md, layer.scaling
    ).reshape(t, nh * d)
    if out_rows is not None:
        if not len(out_rows):
            return h[:0]
        h, attn = h.index_select(0, out_rows), attn.index_select(0, out_rows)
    h = h + layer.o(attn)
    x = norm(h, layer.post_norm, layer.post_eps)
    gu = layer.gate_up(x)
    inter = gu.shape[1] // 2
    act = native_silu_mul(gu) if native else F.silu(gu[:, :inter]) * gu[:, inter:]
    return h + layer.down(act)


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


def _own_remaining_tensors(hf_model: PreTrainedModel, keep: Sequence[torch.Tensor]) -> None:
    """Copy the HF model's other parameters and buffers (norms, biases, tables) out of the checkpoint.

    A CPU checkpoint is loaded as views into the memory-mapped safetensors
    file, and while any one tensor views it the whole mapping stays, with
    every page that building the lean weights read counted as resident
    (the full fp32 file: ~540 MB for SmolLM2-135M). Copying the few small
    tensors left lets it go. ``keep`` (weights the lean decoder shares with
    the HF modules) and released placeholders stay as they are.
    """
    kept = {w.untyped_storage().data_ptr() for w in keep}
    with torch.no_grad():
        for t in [*hf_model.parameters(), *hf_model.buffers()]:
            if t.device.type != "cpu" or 0 in t.stride() or t.untyped_storage().data_ptr() in kept:
                continue
            t.data = t.data.clone()


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
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.final_norm = base.norm.weight
        self.final_eps = float(base.norm.variance_epsilon)
        self.layers: list[LeanLayer] = []
        cpu = self.embed.weight.device.type == "cpu"
        transpose = _transposes(self.embed.weight)
        lm_head = hf_model.get_output_embeddings()
        # fp32 on CPU: weights with an exact group-int8 form live only in that form (their HF
        # copies released), and the elementwise steps run as native calls.
        int8 = self.native_ops = uses_native_ops(self.embed.weight)
        # (linear, HF modules whose weights it holds) for every weight the HF modules gave up.
        self._released: list[tuple[PackedLinear, list[torch.nn.Module]]] = []
        groups = [linear_groups(layer) for layer in base.layers]
        owned = [tuple(self._own_int8(g) if int8 else None for g in layer) for layer in groups]
        lm_int8 = self._own_int8([lm_head]) if int8 else None
        # A tied LM head is the embedding itself: its int8 rows serve the lookup too. Otherwise an
        # embedding with the exact form keeps only that form (a lookup reads a few rows of it).
        tied = lm_head.weight is self.embed.weight
        self.embed_int8 = lm_int8.int8 if lm_int8 is not None and tied else None
        if int8 and not tied:
            self.embed_int8 = self._own_rows_int8(self.embed)
        fused = [
            tuple(o if o is not None else _fuse(g, transpose) for g, o in zip(layer, own))
            for layer, own in zip(groups, owned)
        ]
        # A fp32 tied LM head transposed slows only the embedding lookup (a strided row
        # gather, ~30 ms for a 2,048-token step of SmolLM2).
        lm = lm_int8 if lm_int8 is not None else _fuse([lm_head], transpose)
        # fp32 prepacks the gate/up and LM-head weights, where oneDNN beats MKL; bf16 prepacks all.
        prepack_all = not transpose
        candidates = [ws for layer in fused for ws in (layer if prepack_all else layer[1:2])] + [lm]
        plain = [w for w, _ in (c for c in candidates if isinstance(c, tuple))]
        self.prepack = prepack_enabled(plain)
        pack_rest = self.prepack and prepack_all  # q/k/v, o and down
        if cpu:
            shared = [ws[0] for layer in fused for ws in layer if isinstance(ws, tuple)]
            _own_remaining_tensors(hf_model, keep=shared + ([lm[0]] if isinstance(lm, tuple) else []))

        def linear(weight: PackedLinear | tuple[torch.Tensor, torch.Tensor | None], pack: bool) -> PackedLinear:
            return weight if isinstance(weight, PackedLinear) else PackedLinear(weight[0], weight[1], pack)

        self.lm_head = linear(lm, self.prepack)
        # Greedy rows over an 8-bit LM head take its argmax screened (group_int8_argmax).
        head = self.lm_head.int8 if self.lm_head.bias is None else None
        self.argmax_norms = argmax_screen_norms(head) if head is not None else None
        for layer, (qkv, gate_up, o, down) in zip(base.layers, fused):
            self.layers.append(
                LeanLayer.from_hf(
                    layer, linear(qkv, pack_rest), linear(o, pack_rest), linear(gate_up, self.prepack),
                    linear(down, pack_rest),
                )
            )  # fmt: skip
        self.head_dim = self.layers[0].head_dim
        self.native_layers = self._native_layers()

    def _native_layers(self) -> NativeDecodeLayers | None:
        """Every layer in one native call for plain decode steps, where each is made of what
        that call runs: group-int8 linears, no q/k norm, a head size the kernels take."""
        if not self.native_ops or self.head_dim not in (32, 64, 128) or not self.group_int8:
            return None
        if any(layer.qk_norm is not None for layer in self.layers):
            return None
        weights = [
            DecodeLayerWeights(
                layer.in_norm.contiguous(), layer.in_eps, layer.post_norm.contiguous(), layer.post_eps, layer.scaling,
                *((lin.int8, lin.bias) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)),
            )
            for layer in self.layers
        ]  # fmt: skip
        first = self.layers[0]
        return NativeDecodeLayers(weights, first.num_heads, first.num_kv_heads, self.head_dim)

    def _own_int8(self, linears: Sequence[torch.nn.Linear]) -> PackedLinear | None:
        """The fused linear over ``linears`` in its exact group-int8 form, taking their
        weights over (released from the HF modules), or ``None`` where there is no such form."""
        with torch.no_grad():
            weights = [m.weight.detach() for m in linears]
            enc = encode_group_int8(torch.cat(weights) if len(weights) > 1 else weights[0])
            if enc is None:
                return None
            bias = None
            if any(m.bias is not None for m in linears):
                bias = torch.cat(
                    [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
                )
        del weights
        lin = PackedLinear.from_int8(enc, bias)
        self._release(lin, list(linears))
        return lin

    def _own_rows_int8(self, embedding: torch.nn.Embedding) -> GroupInt8Weight | None:
        """An untied embedding's exact group-int8 form (its HF weight released), or ``None``."""
        enc = encode_group_int8(embedding.weight.detach())
        if enc is not None:
            self._release(PackedLinear.from_int8(enc, None), [embedding])
        return enc

    def _release(self, lin: PackedLinear, modules: list[torch.nn.Module]) -> None:
        # One-element placeholders keep shape, dtype and device for code that reads them.
        for m in modules:
            m.weight.data = m.weight.new_zeros(()).expand(m.weight.shape)
        self._released.append((lin, modules))

    @property
    def group_int8(self) -> bool:
        """Whether every layer's matmul weights are in the group-int8 form (a GGUF-quantized checkpoint)."""
        return all(lin.int8 is not None for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))

    @property
    def holds_hf_weights(self) -> bool:
        """Whether every HF module has its own weights (none released to the int8 form)."""
        return not self._released

    def restore_hf_weights(self) -> None:
        """Give the HF modules back their fp32 weights, rebuilt bit for bit from the int8 forms
        (before anything runs them; the lean decoder keeps reading its int8 weights)."""
        with torch.no_grad():
            for lin, modules in self._released:
                weight = lin.int8.dequantize()
                start = 0
                for m in modules:
                    n = m.weight.shape[0]
                    m.weight.data = weight[start : start + n]
                    start += n
        self._released = []

    def greedy_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax over the LM head by the screened kernel, or ``None`` where it does not run.

        Not for one row: its fp32 logits are the screen's exact pass already (the same
        one-row kernel, so the same token), and reading the weights once is all either
        costs; the screen's extra work made a batch-1 decode 4% slower.
        """
        if self.argmax_norms is None or hidden.shape[0] < 2:
            return None
        return group_int8_argmax(hidden, self.lm_head.int8, self.argmax_norms)

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` input embeddings (from the int8 rows when the lean decoder owns them)."""
        if self.embed_int8 is not None and self._released:
            return group_int8_rows(self.embed_int8, input_ids)
        return self.embed(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_ids(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rope_tables(self.rotary, h, positions, self.head_dim)
        continued = continuing_decode_views(kv_caches, md) if self.native_layers is not None else None
        if continued is not None and kv_caches[0].dtype == torch.float32:
            # A decode or verify step: all layers in one native call, the same kernels in the same order.
            h = h.clone() if inputs_embeds is not None else h.contiguous()  # updated in place
            dense = [(view.keys, view.values) for view in continued.views]
            self.native_layers.run(
                h, cos, sin, kv_caches, dense, md.write_slots, continued.index, md.token_kv_lens, continued.token_rows
            )
            continued_decode_views(continued)
            return native_rms_norm(h, self.final_norm, self.final_eps)
        for layer, cache in zip(self.layers, kv_caches):
            h = layer_forward(layer, h, cos, sin, cache, md, self.native_ops)
        norm = native_rms_norm if self.native_ops else _rms_norm
        return norm(h, self.final_norm, self.final_eps)
