"""An encoder-only worker (the "E" of EPD): towers in, published outputs out.

``EncoderWorker`` is the body of one Ray actor (``remote_encoder`` makes it
one; this module never imports Ray at load time, so it is usable and testable
without a cluster). It holds the checkpoint's vision / audio towers and the
media processor's settings, never the language model, and runs the seed's
``ModelState.execute_mm_encoder``: it encodes and publishes, it never gathers.

Keys. Each output is published under ``namespace/identifier``: the item's
content hash (``multimodal.hashing``, request options and cache salt
included) inside a namespace that hashes what else decides the output: the
towers' weights and configuration, the dtype, and the processor settings
that shaped the encoder input (``encoder_namespace``). Changing the pixel
bounds of the processor, the checkpoint or the dtype therefore changes every
key: an old entry can never be hit.

Publishing policy. An output is ``ray.put`` into the object store, owned by
this actor, and listed in ``published`` with the consumers that asked for it.
An entry leaves the list when its last consumer released it (it loaded the
output, or its request ended) or when it is older than ``ttl_s``; the object
itself is freed by Ray once no consumer holds its reference either. If the
actor dies, the objects it owns are lost with it: consumers see the failure
and encode locally.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.worker.mm.encoder_cache import EncoderCache
from omnistage.worker.model_state import ModelState

__all__ = ["EncodeItem", "EncoderWorker", "encoder_namespace", "towers_fingerprint"]

DEFAULT_TTL_S = 120.0
# Config entries that record how a config was saved or loaded, not what the
# tower computes (the weights' dtypes are hashed with the weights).
_CONFIG_BOOKKEEPING = frozenset({"dtype", "torch_dtype", "_name_or_path", "transformers_version", "architectures"})


@dataclass(frozen=True)
class EncodeItem:
    """One item sent to a worker: its published key, modality, processed
    tensors (a ``MultiModalFeatureSpec.data``) and expected encoder rows."""

    key: str
    modality: str
    data: Any
    num_embeds: int


def _update_tensor(sha: Any, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach().cpu().contiguous().reshape(-1)
    sha.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}|".encode())
    sha.update(t.view(torch.uint8).numpy().tobytes())


def towers_fingerprint(adapter: Any) -> str:
    """SHA-256 of the towers an adapter encodes with: their configurations and
    every weight and buffer, in the dtype they run in. Equal on an engine and on
    an encoder worker exactly when both compute the same outputs."""
    sha = hashlib.sha256()
    for name in ("visual", "audio_tower"):
        tower = getattr(adapter.inner, name, None)
        if tower is None:
            continue
        config = {k: v for k, v in tower.config.to_dict().items() if k not in _CONFIG_BOOKKEEPING}
        sha.update(f"tower {name}|{json.dumps(config, sort_keys=True, default=repr)}".encode())
        for key, tensor in sorted(tower.state_dict().items()):
            _update_tensor(sha, key, tensor)
    sha.update(f"output dtype {adapter.dtype}".encode())
    return sha.hexdigest()


def encoder_namespace(fingerprint: str, processor_settings: dict[str, Any]) -> str:
    """The namespace of published encoder outputs: the towers' fingerprint
    (weights, configuration, dtype) and the processor settings (pixel bounds,
    patch sizes, normalization, mel settings) that shaped the encoder input."""
    settings = json.dumps(processor_settings, sort_keys=True, default=lambda o: getattr(o, "tolist", lambda: repr(o))())
    return hashlib.sha256(f"{fingerprint}|{settings}".encode()).hexdigest()[:32]


@dataclass
class _Published:
    ref: Any  # ray.ObjectRef of the output tensor, owned by this actor
    created: float
    consumers: set[str] = field(default_factory=set)


class EncoderWorker:
    """Encodes items with the towers only and publishes each output.

    ``model_path`` / ``dtype`` / ``device`` name the checkpoint; the language
    model is never loaded (``models.mm_loader.load_mm_encoder``)."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", ttl_s: float = DEFAULT_TTL_S):
        from omnistage.models.mm_loader import load_mm_encoder

        self.adapter = load_mm_encoder(Path(model_path), getattr(torch, dtype), device)
        self.fingerprint = towers_fingerprint(self.adapter)
        self.cache = EncoderCache()
        self.state = ModelState(
            self.adapter, self.cache, 1, self.adapter.hidden_size, self.adapter.dtype, torch.device(device)
        )
        self.ttl_s = ttl_s
        self.published: dict[str, _Published] = {}
        self.num_encoded = 0
        self.delay_s = 0.0  # fault injection for tests: a slow worker

    def info(self) -> dict[str, Any]:
        """What the engine checks before using this worker: the towers' fingerprint."""
        return {"fingerprint": self.fingerprint, "hidden_size": self.adapter.hidden_size}

    def set_delay(self, seconds: float) -> None:
        """Sleep this long before each encode (tests of the engine's deadline)."""
        self.delay_s = float(seconds)

    def encode(self, consumer: str, items: list[EncodeItem]) -> list[Any]:
        """Publish each item's output (encoding those not published yet, in one
        ``execute_mm_encoder`` call) and return their object references, in
        order; ``consumer`` is recorded against each until it releases it."""
        import ray

        self._sweep()
        if self.delay_s:
            time.sleep(self.delay_s)
        todo = [item for item in items if item.key not in self.published]
        if todo:
            features = [
                MultiModalFeatureSpec(
                    data=item.data,
                    modality=item.modality,
                    identifier=item.key,
                    mm_position=PlaceholderRange(offset=0, length=item.num_embeds),
                )
                for item in todo
            ]
            self.cache.add_request(consumer, features)
            try:
                self.state.execute_mm_encoder({consumer: list(range(len(features)))})
            finally:
                self.cache.remove_request(consumer)
            now = time.monotonic()
            for item in todo:
                out = self.cache.encoder_outputs.pop(item.key)
                if out.shape[0] != item.num_embeds:
                    raise RuntimeError(
                        f"encoder worker: {item.modality} item {item.key} gave {out.shape[0]} rows, "
                        f"expected {item.num_embeds}"
                    )
                self.published[item.key] = _Published(ray.put(out.contiguous()), now)
            self.num_encoded += len(todo)
        refs = []
        for item in items:
            entry = self.published[item.key]
            entry.consumers.add(consumer)
            refs.append(entry.ref)
        return refs

    def release(self, consumer: str, keys: list[str]) -> None:
        """``consumer`` is done with these keys; an entry without consumers is unlisted."""
        for key in keys:
            entry = self.published.get(key)
            if entry is None:
                continue
            entry.consumers.discard(consumer)
            if not entry.consumers:
                del self.published[key]
        self._sweep()

    def num_published(self) -> int:
        self._sweep()
        return len(self.published)

    def stats(self) -> dict[str, int]:
        """Entries listed, items encoded, and the object references this
        actor's Ray core worker still tracks: the outputs it owns that it or a
        consumer references (-1 where Ray offers no such count)."""
        return {"published": self.num_published(), "encoded": self.num_encoded, "objects": _num_object_refs()}

    def _sweep(self) -> None:
        """Unlist entries older than the TTL (a consumer that never released)."""
        cutoff = time.monotonic() - self.ttl_s
        for key in [k for k, e in self.published.items() if e.created < cutoff]:
            del self.published[key]


def _num_object_refs() -> int:
    """Ray's reference table size for this process (a private API: -1 if absent)."""
    try:
        import ray

        return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())
    except Exception:  # noqa: BLE001 - a diagnostic only
        return -1
