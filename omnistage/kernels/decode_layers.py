"""A decode step's decoder layers in one native call (``csrc/decode_layers.cpp``).

The lean decoder's layer is a dozen short native calls (norm, fused q/k/v,
RoPE, KV store, decode attention, o, residual, norm, gate/up, SiLU, down,
residual); at batch 1 the Python around them costs about a third of the
step. :class:`NativeDecodeLayers` holds every layer's weight pointers once
and runs the same calls, in the same order, from C: the hidden states come
out bit for bit as from the Python sequence. It serves steps of a few tokens
per sequence (plain decode, speculative verify) whose keys/values go to the
paged cache and to each layer's dense decode view, and whose attention reads
that view; the caller checks that.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.kernels.group_int8 import GroupInt8Weight
from omnistage.kernels.native import native_kernels

__all__ = ["DecodeLayerWeights", "NativeDecodeLayers"]

_P, _L = ctypes.c_void_p, ctypes.c_long


class _Linear(ctypes.Structure):
    _fields_ = [("q", _P), ("d", _P), ("m", _P), ("bias", _P), ("n", _L), ("k", _L), ("bits", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", _P), ("post_norm", _P),
        ("in_eps", ctypes.c_float), ("post_eps", ctypes.c_float), ("scaling", ctypes.c_float),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("cache_k", _P), ("cache_v", _P), ("dense_k", _P), ("dense_v", _P),
    ]  # fmt: skip


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One layer as the native step reads it: its norms and its four group-int8 linears (with biases)."""

    in_norm: torch.Tensor
    in_eps: float
    post_norm: torch.Tensor
    post_eps: float
    scaling: float
    qkv: tuple[GroupInt8Weight, torch.Tensor | None]
    o: tuple[GroupInt8Weight, torch.Tensor | None]
    gate_up: tuple[GroupInt8Weight, torch.Tensor | None]
    down: tuple[GroupInt8Weight, torch.Tensor | None]


def _linear(weight: tuple[GroupInt8Weight, torch.Tensor | None]) -> _Linear:
    w, bias = weight
    return _Linear(
        w.q.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), None if bias is None else bias.data_ptr(),
        w.out_features, w.in_features, w.bits,
    )  # fmt: skip


class NativeDecodeLayers:
    """Every layer's weights in one native table; :meth:`run` is one decode step through all of them."""

    def __init__(self, layers: Sequence[DecodeLayerWeights], num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self._keep = list(layers)  # the table points into these tensors
        self.table = (_Layer * len(layers))()
        for entry, layer in zip(self.table, layers):
            for name in ("in_norm", "post_norm"):
                t = getattr(layer, name)
                if t.dtype != torch.float32 or not t.is_contiguous():
                    raise ValueError(f"NativeDecodeLayers: {name} must be contiguous fp32")
                setattr(entry, name, t.data_ptr())
            entry.in_eps, entry.post_eps, entry.scaling = layer.in_eps, layer.post_eps, layer.scaling
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(entry, name, _linear(getattr(layer, name)))
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden = layers[0].o[0].out_features

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: Sequence[torch.Tensor],
        dense: Sequence[tuple[torch.Tensor, torch.Tensor]],
        slots: torch.Tensor,
        dense_index: torch.Tensor,
        kv_lens: torch.Tensor,
        kv_rows: torch.Tensor | None = None,
    ) -> None:
        """``h`` ``[T, hidden]`` (contiguous fp32, updated in place) through every layer: each
        layer's new keys/values go to its paged cache (``caches[l]``, ``[2, Hkv, blocks,
        block_size, D]``, at ``slots``) and its dense view (``dense[l]``, ``[Hkv, R, capacity,
        D]`` each, at ``dense_index`` of the view flattened to ``[Hkv, R * capacity, D]``), and
        token ``t`` attends to the first ``kv_lens[t]`` columns of view row ``kv_rows[t]``
        (``None``: row ``t``, one token per row). ``cos``/``sin`` ``[T, 1, D]`` contiguous."""
        if not (h.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("NativeDecodeLayers.run: h, cos and sin must be contiguous")
        keys0 = dense[0][0]
        head_stride = caches[0][0][0].numel()  # one KV head's slots in a cache half
        for entry, cache, (keys, values) in zip(self.table, caches, dense):
            entry.cache_k, entry.cache_v = cache[0].data_ptr(), cache[1].data_ptr()
            entry.dense_k, entry.dense_v = keys.data_ptr(), values.data_ptr()
        native_kernels().decode_layers(
            ctypes.addressof(self.table), len(self.table), h.data_ptr(), h.shape[0], self.hidden, self.num_heads,
            self.num_kv_heads, self.head_dim, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), head_stride,
            dense_index.data_ptr(), keys0.shape[2], keys0.stride(0), None if kv_rows is None else kv_rows.data_ptr(),
            kv_lens.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
