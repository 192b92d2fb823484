"""HostCopier: the side-stream copy of per-token rows into reused host buffers.

On CPU the device half is ``DeferredCopyDevice``: copies run only when waited
for (or polled complete) and new buffers hold a poison value, so these tests
see a read before ``wait``, a copy out of stream order and a buffer reused
while a consumer still holds it. The same bookkeeping drives CudaCopyDevice;
the CUDA test at the end checks the real device half where one is present.
"""

from __future__ import annotations

import gc

import pytest
import torch

from omnistage.worker.host_copy import (
    CudaCopyDevice,
    DeferredCopyDevice,
    HostBuffers,
    HostCopier,
)


def _rows(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_rows_arrive_only_when_waited_for():
    device = DeferredCopyDevice(polls_to_complete=100)
    copier = HostCopier(device)
    src = _rows(5, 0)
    pending = copier.start(src)
    assert device.copies_run == 0  # queued, not run: the host was not blocked
    got = pending.wait()
    assert device.copies_run == 1 and torch.equal(got, src)
    assert pending.wait() is got and device.copies_run == 1  # one wait, one copy


def test_a_read_before_wait_sees_poison_not_rows():
    copier = HostCopier(DeferredCopyDevice(polls_to_complete=100))
    pending = copier.start(_rows(3, 1))
    early = pending._rows  # what a consumer skipping wait() would read
    assert torch.isnan(early).all()
    assert not torch.isnan(pending.wait()).any()


def test_waiting_on_a_later_copy_runs_the_earlier_ones_in_order():
    device = DeferredCopyDevice(polls_to_complete=100)
    copier = HostCopier(device)
    first, second = copier.start(_rows(4, 2)), copier.start(_rows(4, 3))
    second.wait()
    assert device.copies_run == 2
    assert torch.equal(first.wait(), _rows(4, 2)) and device.copies_run == 2


def test_buffer_is_reused_once_its_rows_are_freed():
    copier = HostCopier(DeferredCopyDevice())
    got = copier.start(_rows(6, 4)).wait()
    parts = torch.split_with_sizes(got, [2, 4])  # how the runner hands rows out
    del got
    gc.collect()
    held = copier.start(_rows(6, 5)).wait()  # a consumer still holds parts[1]
    assert copier.buffers.allocated == 2 and copier.buffers.reused == 0
    assert torch.equal(parts[1], _rows(6, 4)[2:])  # not overwritten
    del parts, held
    gc.collect()
    again = copier.start(_rows(9, 6)).wait()  # 16-row buffers: both free now
    assert copier.buffers.reused == 1 and torch.equal(again, _rows(9, 6))


def test_buffer_is_not_reused_before_its_copy_completes():
    device = DeferredCopyDevice(polls_to_complete=3)
    copier = HostCopier(device)
    copier.start(_rows(4, 7))  # never waited for, dropped at once
    gc.collect()
    copier.start(_rows(4, 8))  # poll 1: copy in flight, so a new buffer
    assert copier.buffers.allocated == 2 and device.copies_run == 0
    copier.start(_rows(4, 9))  # polls 2 and 3: the first copy completes (stream order)
    assert copier.buffers.reused == 1 and device.copies_run == 1


def test_capacity_rounds_up_and_serves_smaller_and_mixed_shapes():
    copier = HostCopier(DeferredCopyDevice())
    copier.start(_rows(17, 0)).wait()
    gc.collect()
    copier.start(_rows(30, 1)).wait()
    gc.collect()
    assert copier.buffers.allocated == 1 and copier.buffers.reused == 1  # 32 rows
    bf16 = copier.start(_rows(3, 2, torch.bfloat16)).wait()  # another dtype: its own buffer
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, _rows(3, 2, torch.bfloat16))
    assert copier.buffers.allocated == 2
    assert copier.start(torch.empty(0, 8)).wait().shape == (0, 8)


def test_idle_and_tracked_buffers_are_bounded():
    buffers = HostBuffers(DeferredCopyDevice(polls_to_complete=1), max_idle=1, max_tracked=3)
    kept = [buffers.take(16 << k, (4,), torch.float32)[0] for k in range(5)]  # all held
    assert buffers.num_buffers() == 3  # the oldest busy ones are left to their consumers
    del kept
    gc.collect()
    buffers.take(1 << 10, (4,), torch.float32)
    assert buffers.num_buffers() == 2  # the new one and at most one idle


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_lands_in_pinned_memory_and_reuses_it():
    copier = HostCopier(CudaCopyDevice(torch.device("cuda")))
    src = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    pending = copier.start(src * 2)  # the temporary is freed at once: record_stream keeps it
    got = pending.wait()
    assert got.is_pinned() and torch.equal(got, (src * 2).cpu())
    del got, pending
    gc.collect()
    again = copier.start(src).wait()
    assert copier.buffers.reused == 1 and torch.equal(again, src.cpu())
