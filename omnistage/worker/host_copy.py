"""Device-to-host copies of a step's per-token rows that do not block the host.

``HostCopier.start(rows)`` queues the copy of ``rows`` (a device tensor the
compute stream is producing) into a host buffer on a side stream, ordered
after the work that produces them, and returns at once; ``PendingRows.wait()``
blocks the host on that copy alone, the first time it is called. The runner
starts the copy right after the forward and waits after sampling, so the copy
runs under the LM head and the sampler, and the step's only host sync stays
the one that reads the sampled tokens.

Policy of the host buffers (``HostBuffers``): a buffer is reused only when
(a) every tensor handed out over it has been freed by its consumers, and (b)
the copy that last wrote it has completed. Sizes are rounded up to a power of
two rows, so the same few buffers serve step after step.

What is device-specific lives in a ``CopyDevice``: ``CudaCopyDevice`` (a side
``torch.cuda.Stream``, CUDA events, pinned host memory, ``record_stream`` so
the caching allocator does not hand the source's memory to later kernels
before the copy has read it), and ``DeferredCopyDevice``, its CPU model:
copies are queued and run only when an event they precede is waited on or
polled complete, and new host buffers are filled with a poison value, so a
test on CPU sees any read before ``wait()`` and any missing ordering.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = [
    "CopyDevice",
    "CudaCopyDevice",
    "DeferredCopyDevice",
    "HostBuffers",
    "HostCopier",
    "PendingRows",
]


class CopyDevice(Protocol):
    """The device half of an asynchronous device-to-host copy."""

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer the device can copy into without staging (pinned)."""
        ...

    def record_compute(self) -> Any:
        """An event on the compute stream, after the work queued so far."""
        ...

    def copy_after(self, event: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Queue ``dst.copy_(src)`` on the side stream after ``event``; return an
        event that completes when the copy has."""
        ...

    def is_done(self, event: Any) -> bool: ...

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""
        ...


class CudaCopyDevice:
    """Side stream, events and pinned host memory of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def record_compute(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy_after(self, event: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # The compute stream may free ``src`` as soon as the runner drops it:
        # its memory must not go to later kernels before this stream has read it.
        src.record_stream(self.stream)
        return done

    def is_done(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any) -> None:
        event.synchronize()


class _DeferredEvent:
    __slots__ = ("done", "op", "polls")

    def __init__(self, op: Callable[[], None] | None) -> None:
        self.op = op  # the side-stream op the event follows; dropped once run
        self.done = op is None
        self.polls = 0


class DeferredCopyDevice:
    """A CPU model of ``CudaCopyDevice`` with the same ordering rules.

    A copy is queued, not run: it runs, after everything queued before it,
    when an event recorded after it is waited on or has been polled
    ``polls_to_complete`` times. Host buffers start filled with a poison value
    (NaN, or all bits set), so a read that comes before ``wait`` shows as wrong
    data. ``copies_run`` counts executed copies.
    """

    def __init__(self, polls_to_complete: int = 2) -> None:
        self.polls_to_complete = polls_to_complete
        self.copies_run = 0
        self._queue: list[_DeferredEvent] = []  # the side stream, in order

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        if dtype.is_floating_point:
            buffer.fill_(float("nan"))
        else:
            buffer.view(torch.uint8).fill_(255)
        return buffer

    def record_compute(self) -> Any:
        return _DeferredEvent(None)  # CPU compute is done when it returns

    def copy_after(self, event: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        def copy() -> None:
            dst.copy_(src)
            self.copies_run += 1

        event = _DeferredEvent(copy)
        self._queue.append(event)
        return event

    def is_done(self, event: Any) -> bool:
        if not event.done:
            event.polls += 1
            if event.polls >= self.polls_to_complete:
                self.wait(event)
        return event.done

    def wait(self, event: Any) -> None:
        while not event.done:  # stream order: everything queued before it runs first
            head = self._queue.pop(0)
            head.op()
            head.op, head.done = None, True


class HostBuffers:
    """Host buffers for copies from the device, reused step after step.

    Policy: a buffer goes back to use only when every tensor handed out over
    it has been freed (its storage watched through a weak reference) and the
    copy that last wrote it has completed (asked with ``CopyDevice.is_done``,
    never by blocking). Capacities are powers of two rows, at least 16; at
    most ``max_idle`` idle buffers are kept per (dtype, row shape).
    """

    def __init__(self, device: CopyDevice, max_idle: int = 4, max_tracked: int = 32) -> None:
        self.device = device
        self.max_idle = max_idle
        self.max_tracked = max_tracked
        self.allocated = 0  # buffers created, for tests and benchmarks
        self.reused = 0
        self._slots: dict[tuple[torch.dtype, tuple[int, ...]], list[_Slot]] = {}

    def take(self, rows: int, trailing: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, _Slot]:
        """``rows`` rows of a free buffer, as a tensor whose storage (and every
        view of it a consumer makes) keeps the slot busy; and the slot."""
        slots = self._slots.setdefault((dtype, trailing), [])
        found = None
        for slot in slots:
            if slot.capacity >= rows and slot.is_free(self.device):
                found = slot
                self.reused += 1
                break
        if found is None:
            capacity = max(16, 1 << max(rows - 1, 0).bit_length())
            found = _Slot(self.device.host_empty((capacity, *trailing), dtype))
            self.allocated += 1
            slots.append(found)
            idle = [s for s in slots if s is not found and s.is_free(self.device)]
            for slot in idle[: max(len(idle) - self.max_idle, 0)]:
                slots.remove(slot)
            if len(slots) > self.max_tracked:
                # Consumers hold the oldest ones: forget them (their memory is
                # freed with the consumers' last views) rather than scan them.
                del slots[: len(slots) - self.max_tracked]
        return found.hand_out(rows), found

    def num_buffers(self) -> int:
        return sum(len(s) for s in self._slots.values())


class _Slot:
    __slots__ = ("buffer", "capacity", "event", "user")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.capacity = buffer.shape[0]
        self.user: weakref.ref | None = None  # the NumPy view every handed-out tensor keeps alive
        self.event: Any = None  # the copy that last wrote the buffer

    def is_free(self, device: CopyDevice) -> bool:
        if self.event is not None and not device.is_done(self.event):
            return False
        return self.user is None or self.user() is None

    def hand_out(self, rows: int) -> torch.Tensor:
        # A fresh tensor over a NumPy view of the first ``rows`` rows: its
        # storage holds that view, so the view dies with the last tensor
        # sharing the storage, whatever slices or splits consumers make.
        raw = self.buffer.view(self.capacity, -1).view(torch.uint8)
        view = raw.numpy()[:rows]
        self.user = weakref.ref(view)
        trailing = self.buffer.shape[1:]
        return torch.from_numpy(view).view(self.buffer.dtype).view(rows, *trailing)


class PendingRows:
    """A device-to-host copy in flight; ``wait()`` returns the host rows."""

    __slots__ = ("_device", "_event", "_rows", "_source")

    def __init__(self, device: CopyDevice, event: Any, rows: torch.Tensor, source: torch.Tensor) -> None:
        self._device = device
        self._event = event
        self._rows = rows
        self._source = source  # kept alive until the copy has read it

    def wait(self) -> torch.Tensor:
        """The host rows, blocking on their copy the first time."""
        if self._source is not None:
            self._device.wait(self._event)
            self._source = None
        return self._rows


class HostCopier:
    """Starts copies of device rows into reusable host buffers on a side stream."""

    def __init__(self, device: CopyDevice) -> None:
        self.device = device
        self.buffers = HostBuffers(device)

    def start(self, rows: torch.Tensor) -> PendingRows:
        """Queue the copy of ``rows`` (any device) after the compute queued so far."""
        dst, slot = self.buffers.take(rows.shape[0], tuple(rows.shape[1:]), rows.dtype)
        slot.event = self.device.copy_after(self.device.record_compute(), dst, rows)
        return PendingRows(self.device, slot.event, dst, rows)
