"""Host allocator settings for a long-running engine process."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


@functools.cache
def keep_freed_host_memory() -> bool:
    """Make glibc keep freed blocks of up to 1 GiB in the heap for reuse.

    By default glibc serves buffers over 32 MiB with fresh ``mmap`` pages and
    returns freed memory to the OS, so every step that allocates a large
    output (a prefill's hidden states, a merged prefix from the tensor prefix
    cache) pays a page fault per 4 KiB on first touch, which costs about twice
    the copy itself. An engine allocates the same sizes step after step, so
    reusing freed memory is the right trade. Returns False where the C
    library is not glibc (nothing changes there).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_BYTES))
