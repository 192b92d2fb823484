"""omnistage.envs: the one module that reads environment variables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import omnistage
from omnistage import envs

PACKAGE = Path(omnistage.__file__).parent


def test_no_other_module_reads_the_environment():
    readers = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "envs.py" and re.search(r"os\.environ|os\.getenv|getenv\(", path.read_text(encoding="utf-8"))
    ]
    assert readers == []


def test_every_omnistage_variable_is_documented_here():
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"OMNISTAGE_[A-Z_]+[A-Z]", path.read_text(encoding="utf-8")))
    declared = {v.name for v in envs.VARIABLES}
    assert named <= declared, named - declared
    for var in envs.VARIABLES:
        assert f"``{var.name}``" in envs.__doc__, var.name  # name, default and meaning in the module docstring


def test_switches_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("OMNISTAGE_NATIVE", raising=False)
    assert envs.native_enabled()
    for off in ("0", "false", "No", " OFF "):
        monkeypatch.setenv("OMNISTAGE_NATIVE", off)
        assert not envs.native_enabled()
    monkeypatch.setenv("OMNISTAGE_NATIVE", "1")
    assert envs.native_enabled()
    monkeypatch.setenv("OMNISTAGE_LEAN_FORWARD", "0")
    monkeypatch.setenv("OMNISTAGE_PREPACK", "off")
    assert not envs.lean_forward_enabled() and not envs.prepack_enabled()


def test_byte_counts(monkeypatch):
    monkeypatch.delenv("OMNISTAGE_DENSE_DECODE_BYTES", raising=False)
    monkeypatch.delenv("OMNISTAGE_PREPACK_MAX_BYTES", raising=False)
    assert envs.dense_decode_bytes() == 1 << 30 and envs.prepack_max_bytes() == 2 << 30
    monkeypatch.setenv("OMNISTAGE_DENSE_DECODE_BYTES", "0")
    assert envs.dense_decode_bytes() == 0
    monkeypatch.setenv("OMNISTAGE_PREPACK_MAX_BYTES", "1_000")
    assert envs.prepack_max_bytes() == 1000
    for bad in ("1GB", "-1", ""):
        monkeypatch.setenv("OMNISTAGE_DENSE_DECODE_BYTES", bad)
        with pytest.raises(ValueError, match="OMNISTAGE_DENSE_DECODE_BYTES=.*whole number of bytes"):
            envs.dense_decode_bytes()


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", "~/x")
    assert envs.cache_dir() == Path.home() / "x"
    monkeypatch.delenv("OMNISTAGE_CACHE_DIR")
    assert envs.cache_dir() == Path.home() / ".cache" / "omnistage"
