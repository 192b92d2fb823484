"""Where the native kernels are built: a cache folder the process cannot write never fails a load."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from omnistage.kernels import native

pytestmark = pytest.mark.skipif(native.native_kernels() is None, reason="native kernels need x86-64 AVX2 and g++")


def test_an_unwritable_cache_folder_builds_in_a_temporary_one(tmp_path, monkeypatch):
    built = native.native_kernels()._name  # the library this machine built (in the cache)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(native, "cache_root", lambda: blocker / "cache")  # below a file: not creatable
    real_run, outputs = subprocess.run, []

    def compiler(cmd, **kwargs):  # the build's own command line, served by the library already built
        if "-o" not in cmd:
            return real_run(cmd, **kwargs)
        outputs.append(cmd[cmd.index("-o") + 1])
        shutil.copyfile(built, outputs[-1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(native.subprocess, "run", compiler)
    native.native_kernels.cache_clear()
    try:
        lib = native.native_kernels()
        folder = native.Path(outputs[0]).parent.parent  # the compiler writes in a scratch folder inside it
        assert lib is not None and folder.name.startswith(native._TEMP_PREFIX)
        assert not folder.exists()  # the per-process copy is removed once loaded
        # And where even that fails, the torch ops serve.
        monkeypatch.setattr(native, "_build", lambda *a: (_ for _ in ()).throw(OSError("no space left")))
        native.native_kernels.cache_clear()
        assert native.native_kernels() is None
    finally:
        monkeypatch.undo()
        native.native_kernels.cache_clear()
        assert native.native_kernels() is not None
