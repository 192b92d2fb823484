"""The language-model engine's side of encoder-only workers, on Ray.

``RemoteEncoderPool`` starts (or attaches to) ``num_workers`` named
``EncoderWorker`` actors, sends each admitted request's items to one of them
at once, so that they are encoded while the running batch decodes, and hands
finished outputs to the model runner, which loads them before the gather.

Policy:

- **Which items.** Every item with data whose output the engine does not hold
  already; equal identifiers share one entry (one encode) whatever the number
  of requests carrying them.
- **States.** An entry is *pending* (its encode task runs), *ready* (the
  worker published the output) or gone. The scheduler sees the identifiers of
  pending and ready entries as plain data: it waits for a pending item (its
  window stops before it), plans a ready one as a load, counted against
  encoder-cache space but not against the step's encoder compute budget, and
  encodes any other item itself.
- **Failure is local encoding.** An encode task that fails (the worker
  died), an entry pending past ``timeout_s``, a load that fails (the owner
  died, the object was lost) or returns a tensor of the wrong shape: the
  entry is dropped and the item is encoded in the engine, as without workers.
  Never an engine error, never a lost request. A dead worker is replaced in
  the background; until its successor answers, items go to the others (or
  are encoded locally when none is left).
- **Memory.** An entry is released (the engine drops its reference and tells
  the worker) as soon as the runner loaded it, or when its last request
  ended; the worker also unlists entries older than its TTL. So the object
  store holds at most the outputs of the requests in flight.
- **Sharing.** Workers are named by the towers' fingerprint, so every engine
  (data-parallel replica) of one checkpoint and dtype in a Ray namespace
  shares them and their published outputs; an identifier always goes to the
  same worker (its hash picks one of the live workers), so concurrent
  requests of different engines for one image share one encode. Keys carry
  the processor's settings too, so engines whose processors differ never
  share an entry.
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.models.mm_loader import MM_MODEL_TYPES
from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.ray_cluster import RAY_NAMESPACE, actor_resources, connect_ray
from omnistage.worker.mm.encoder_worker import (
    EncodeItem,
    EncoderWorker,
    encoder_namespace,
    towers_fingerprint,
)

__all__ = ["RemoteEncoderPool"]

logger = logging.getLogger(__name__)

_RESPAWN_BACKOFF_S = 2.0


@dataclass
class _Entry:
    identifier: str
    key: str
    worker: int
    task: Any  # ObjectRef of the encode task's list of output refs
    index: int  # this item's place in that list
    submitted: float
    requests: set[str] = field(default_factory=set)
    output: Any = None  # ObjectRef of the published tensor, once ready


@dataclass
class _Worker:
    name: str
    handle: Any = None
    ready: Any = None  # ObjectRef of its info() while it starts
    alive: bool = False
    spawned_at: float = 0.0
    refused: bool = False  # it runs other towers (a stale deployment under this name): never used


class RemoteEncoderPool:
    """Encoder-only Ray actors for one engine; see the module policy."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        device: str,
        num_workers: int,
        fingerprint: str,
        namespace: str,
        hidden_size: int,
        timeout_s: float = 10.0,
    ) -> None:
        import ray

        connect_ray()
        self._ray = ray
        self.model_path, self.dtype, self.device = model_path, dtype, device
        self.fingerprint, self.namespace, self.hidden_size = fingerprint, namespace, hidden_size
        self.timeout_s = timeout_s
        self.consumer = f"engine-{uuid.uuid4().hex[:12]}"
        self.entries: dict[str, _Entry] = {}
        self.workers = [_Worker(f"omnistage-encoder-{fingerprint[:16]}-{i}") for i in range(num_workers)]
        for worker in self.workers:
            self._spawn(worker)
        self.num_submitted = self.num_loaded = self.num_failed = self.num_calls = 0

    @classmethod
    def for_model(cls, loaded_model: Any, processor: Any, args: Any) -> RemoteEncoderPool:
        """The pool of an engine's multimodal model (``EngineArgs.num_encoder_workers``); a
        model whose towers no worker can load alone is refused (every worker would fail to
        start, be respawned, and fail again)."""
        adapter = loaded_model.mm_adapter
        model_type = getattr(adapter.config, "model_type", None)
        if model_type not in MM_MODEL_TYPES:
            raise ValueError(
                f"num_encoder_workers={args.num_encoder_workers}: encoder-only workers are not supported for "
                f"model type {model_type!r} yet (they run {list(MM_MODEL_TYPES)}); use 0"
            )
        fingerprint = towers_fingerprint(adapter)
        return cls(
            str(loaded_model.model_path),
            args.dtype,
            args.device,
            args.num_encoder_workers,
            fingerprint,
            encoder_namespace(fingerprint, processor.encoder_settings()),
            adapter.hidden_size,
            args.encoder_worker_timeout_s,
        )

    # -- workers -------------------------------------------------------------

    def _spawn(self, worker: _Worker) -> None:
        ray = self._ray
        resources = actor_resources(self.device)
        actor = ray.remote(EncoderWorker).options(
            name=worker.name,
            namespace=RAY_NAMESPACE,
            get_if_exists=True,
            max_restarts=0,
            max_concurrency=1,
            **resources,
        )
        worker.handle = actor.remote(self.model_path, self.dtype, self.device)
        worker.ready = worker.handle.info.remote()
        worker.alive = False
        worker.spawned_at = time.monotonic()

    def _check_workers(self) -> None:
        """Take workers that finished starting into use; replace dead ones."""
        ray = self._ray
        for worker in self.workers:
            if worker.ready is not None:
                done, _ = ray.wait([worker.ready], timeout=0)
                if not done:
                    continue
                try:
                    info = ray.get(worker.ready)
                except Exception as exc:  # noqa: BLE001 - a worker that cannot start is replaced later
                    logger.warning("encoder worker %s did not start: %s", worker.name, exc)
                    worker.ready, worker.handle = None, None
                    continue
                worker.ready = None
                if info["fingerprint"] != self.fingerprint or info["hidden_size"] != self.hidden_size:
                    logger.warning("encoder worker %s runs other towers than this engine; not used", worker.name)
                    worker.handle, worker.refused = None, True
                    continue
                worker.alive = True
            elif (
                worker.handle is None
                and not worker.refused
                and time.monotonic() - worker.spawned_at > _RESPAWN_BACKOFF_S
            ):
                self._spawn(worker)

    def _worker_died(self, index: int) -> None:
        worker = self.workers[index]
        if worker.alive:
            logger.warning("encoder worker %s died; its items are encoded locally", worker.name)
        worker.alive, worker.handle, worker.ready = False, None, None
        worker.spawned_at = time.monotonic()
        for entry in [e for e in self.entries.values() if e.worker == index]:
            self._drop(entry, notify=False)

    @property
    def num_alive(self) -> int:
        return sum(w.alive for w in self.workers)

    # -- requests ------------------------------------------------------------

    def submit(self, req_ids: list[str], features: list[MultiModalFeatureSpec], held: Any = ()) -> None:
        """Send the items of one request (``req_ids``: its child requests) to a
        worker; items whose identifier is in ``held`` (the engine's encoder
        cache) or already submitted only gain the requests."""
        self._check_workers()
        alive = [i for i, w in enumerate(self.workers) if w.alive]
        new: list[MultiModalFeatureSpec] = []
        for feature in features:
            entry = self.entries.get(feature.identifier)
            if entry is not None:
                entry.requests.update(req_ids)
            elif (
                feature.data is not None
                and feature.identifier not in held
                and alive
                and all(f.identifier != feature.identifier for f in new)
            ):
                new.append(feature)
        if not new:
            return
        # An identifier always goes to the same worker (while the set of live
        # workers stays): engines sharing the workers then share its encode.
        by_worker: dict[int, list[MultiModalFeatureSpec]] = {}
        for feature in new:
            by_worker.setdefault(alive[zlib.crc32(feature.identifier.encode()) % len(alive)], []).append(feature)
        now = time.monotonic()
        for index, group in by_worker.items():
            items = [
                EncodeItem(self._key(f.identifier), f.modality, f.data, f.mm_position.get_num_embeds()) for f in group
            ]
            task = self.workers[index].handle.encode.remote(self.consumer, items)
            self.num_calls += 1
            for k, feature in enumerate(group):
                self.entries[feature.identifier] = _Entry(
                    feature.identifier, items[k].key, index, task, k, now, set(req_ids)
                )
        self.num_submitted += len(new)

    def _key(self, identifier: str) -> str:
        return f"{self.namespace}/{identifier}"

    def poll(self) -> None:
        """Resolve finished encode tasks; drop failed and overdue entries."""
        self._check_workers()
        ray = self._ray
        pending = {}
        for entry in self.entries.values():
            if entry.output is None:
                pending.setdefault(entry.task, []).append(entry)
        if not pending:
            return
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for task in done:
            try:
                refs = ray.get(task)
            except Exception as exc:  # noqa: BLE001 - the worker died or the encode raised: encode locally
                entries = pending.pop(task)
                logger.warning("encoder worker task failed (%s); %d item(s) go local", type(exc).__name__, len(entries))
                if isinstance(exc, ray.exceptions.RayActorError):
                    self._worker_died(entries[0].worker)
                for entry in entries:
                    self._drop(entry, notify=False)
                continue
            for entry in pending.pop(task):
                entry.output = refs[entry.index]
        deadline = time.monotonic() - self.timeout_s
        for entries in pending.values():
            for entry in entries:
                if entry.submitted < deadline:
                    self.num_failed += 1
                    self._drop(entry)

    def pending_ids(self) -> set[str]:
        return {i for i, e in self.entries.items() if e.output is None}

    def ready_ids(self) -> set[str]:
        return {i for i, e in self.entries.items() if e.output is not None}

    def wait(self, timeout: float) -> None:
        """Block until some encode task finishes, or ``timeout`` seconds (an
        engine with nothing else to run waits here instead of spinning)."""
        tasks = list({id(e.task): e.task for e in self.entries.values() if e.output is None}.values())
        if tasks:
            self._ray.wait(tasks, num_returns=1, timeout=timeout)

    def load(self, identifier: str, num_embeds: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The published output of ``identifier`` as ``[num_embeds, hidden]``, or
        None (then the caller encodes it). The entry is released either way."""
        entry = self.entries.get(identifier)
        if entry is None or entry.output is None:
            return None
        try:
            out = self._ray.get(entry.output, timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - lost with its owner, or late: encode locally
            logger.warning("encoder output %s could not be loaded (%s); encoding locally", identifier, exc)
            out = None
        self._drop(entry)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (num_embeds, self.hidden_size):
            self.num_failed += 1
            return None
        self.num_loaded += 1
        return out.to(device=device, dtype=dtype)

    def release_ended(self, live: Any) -> None:
        """Forget requests not in ``live``; entries left without a request are released."""
        for entry in list(self.entries.values()):
            entry.requests.intersection_update(live)
            if not entry.requests:
                self._drop(entry)

    def _drop(self, entry: _Entry, notify: bool = True) -> None:
        if self.entries.get(entry.identifier) is not entry:
            return
        del self.entries[entry.identifier]
        worker = self.workers[entry.worker]
        if notify and worker.handle is not None:
            # Runs after the encode task on the same actor (calls from one caller
            # run in order), so a late output is unlisted as soon as it appears.
            worker.handle.release.remote(self.consumer, [entry.key])

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    def worker_stats(self) -> list[dict[str, int] | None]:
        """Each live worker's published entries and items encoded (None: not alive)."""
        ray = self._ray
        return [ray.get(w.handle.stats.remote()) if w.alive else None for w in self.workers]

    def close(self) -> None:
        """Release every entry (the workers stay: other engines may share them)."""
        for entry in list(self.entries.values()):
            self._drop(entry)
