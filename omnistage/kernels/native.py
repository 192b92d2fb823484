"""Build and load omnistage's native CPU kernels (``csrc/*.cpp``) on first use.

The sources are compiled into one library, once per machine, with the
system C++ compiler (``-O3 -march=native -ffp-contract=off -fopenmp``) into
``cache_root()/kernels``, keyed by a hash of the sources, the compiler and
the CPU's flags, and loaded with ``ctypes``. No torch headers are
involved, so a build takes a few seconds. The kernels are written once
against ``csrc/simd.h``'s 16-lane vector, which ``-march=native`` makes one
AVX-512 register or two AVX2 ones, so they run on both kinds of x86-64 CPU.
Where they cannot be had (not x86-64 with AVX2, FMA and F16C, no compiler,
a failed build, or ``OMNISTAGE_NATIVE=0``) :func:`native_kernels` returns ``None``
and callers keep their torch path.

OpenMP: the library links ``libgomp.so.1`` by soname, which resolves to the
copy torch has already loaded, so the kernels share torch's thread pool;
callers pass ``torch.get_num_threads()`` on every call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from omnistage import envs
from omnistage.cache_dir import cache_root

__all__ = ["NATIVE_ENV", "native_kernels"]

NATIVE_ENV = envs.NATIVE.name  # "0" turns the native kernels off
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_REQUIRED_CPU_FLAGS = {"avx2", "fma", "f16c"}  # AVX-512 is used where -march=native has it
_logger = logging.getLogger(__name__)

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURES = {
    # x, M, K, q, bits, d, m, y, N, threads
    "group_int8_gemm": (None, [_P, _L, _L, _P, _I, _P, _P, _P, _L, _I]),
    # w, N, K, q, d, m, threads -> 1 when exact
    "group_int8_encode": (_I, [_P, _L, _L, _P, _P, _P, _I]),
    # -> 1 where the build has the screened argmax (AVX-512 VNNI)
    "group_int8_argmax_available": (_I, []),
    # x, M, K, q, d, m, norms, N, ids, threads -> 1 when answered
    "group_int8_argmax": (_I, [_P, _L, _L, _P, _P, _P, _P, _L, _P, _I]),
    # q, q_seq_stride, q_head_stride, k, v, kv_head_stride, kv_seq_stride, kv_rows, seq_lens, R, H, Hkv, D, scale,
    # out, threads -> 0 for an unsupported head size
    "decode_attention": (_I, [_P, _L, _L, _P, _P, _L, _L, _P, _P, _L, _L, _L, _L, ctypes.c_float, _P, _I]),
    # x, M, K, weight, eps, out, threads
    "rms_norm": (None, [_P, _L, _L, _P, ctypes.c_float, _P, _I]),
    # x, T, H, D, x_stride, cos, sin, out, threads
    "rope": (None, [_P, _L, _L, _L, _L, _P, _P, _P, _I]),
    # gu, M, I, out, threads
    "silu_mul": (None, [_P, _L, _L, _P, _I]),
    # layers, L, h, T, hidden, H, Hkv, D, cos, sin, slots, cache_hs, dense_idx, capacity, dense_hs, kv_rows,
    # seq_lens, threads
    "decode_layers": (None, [_P, _L, _P, _L, _L, _L, _L, _L, _P, _P, _P, _L, _P, _L, _L, _P, _P, _I]),
    # k, k_hs, k_ts, v, v_hs, v_ts, H, T, D, dst_k, dst_v, dst_hs, idx, dense_k, dense_v, dense_hs, dense_idx
    "kv_store": (None, [_P, _L, _L, _P, _L, _L, _L, _L, _L, _P, _P, _L, _P, _P, _P, _L, _P]),
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_TEMP_PREFIX = "omnistage_kernels_tmp_"  # a build for one process, where the cache folder is not writable


def _build(compiler: str, flags: set[str]) -> Path | None:
    """The compiled library for these sources, compiler and CPU (built now if not cached)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(b"".join(src.read_bytes() for src in sorted(_CSRC.glob("*.[ch]*"))))
    digest.update(version.encode() + " ".join(sorted(flags)).encode())
    path = cache_root() / "kernels" / f"omnistage_kernels-{digest.hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. a read-only home: this process builds its own copy
        _logger.warning("omnistage: cannot write %s (%s); building the native kernels in a temporary folder",
                        path.parent, exc)  # fmt: skip
        path = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX)) / path.name
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        # No fp contraction: a * b + c must round twice where the torch op it replaces does.
        options = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
        cmd = [compiler, *options, *map(str, _SOURCES), "-o", str(out)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode != 0:
            _logger.warning("omnistage: building the native kernels failed; using torch ops\n%s", built.stderr[-2000:])
            return None
        os.replace(out, path)  # atomic: concurrent builders each install a complete file
    return path


@functools.cache
def native_kernels() -> ctypes.CDLL | None:
    """The native kernel library, or ``None`` where it cannot be built or run here."""
    if not envs.native_enabled():
        return None
    flags = _cpu_flags()
    compiler = shutil.which(envs.cxx())
    if platform.machine() != "x86_64" or not _REQUIRED_CPU_FLAGS <= flags or compiler is None:
        return None
    try:
        path = _build(compiler, flags)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
        if path.parent.name.startswith(_TEMP_PREFIX):  # loaded: the file can go
            shutil.rmtree(path.parent, ignore_errors=True)
    except OSError as exc:  # a folder or library the process cannot use: the torch ops serve
        _logger.warning("omnistage: the native kernels cannot be built or loaded here (%s); using torch ops", exc)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
