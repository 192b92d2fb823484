import ctypes.util

import pytest
import torch

from omnistage.worker.host_memory import keep_freed_host_memory


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library found")
def test_keeps_freed_memory_and_is_idempotent():
    first = keep_freed_host_memory()
    assert keep_freed_host_memory() is first
    # Large buffers still allocate and hold what is written (the setting only
    # changes where freed memory goes).
    for _ in range(3):
        buf = torch.empty(40 * 1024 * 1024 // 4)
        buf.fill_(1.5)
        assert float(buf[-1]) == 1.5
        del buf
