"""Shared fixtures for engine tests: tiny checkpoints, loaded models, HF greedy references."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from utils_engine import hf_greedy

from omnistage.core import spec_policy
from omnistage.models.loader import LoadedModel, load_model
from omnistage.testing.tiny_checkpoints import TINY_ARCHS, write_tiny_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every engine test module runs with one intra-op thread (see tests/conftest.py)."""


@pytest.fixture
def always_draft(monkeypatch):
    """For tests of verification, rollback and caching: every n-gram proposal is
    verified at full length (a free verify step for the draft policy, which
    test_spec_policy.py tests on its own)."""
    monkeypatch.setattr(spec_policy, "DEFAULT_VERIFY_COSTS", {1: ((1, 1.0), (2, 1.0))})
    monkeypatch.setattr(spec_policy, "DEFAULT_DECODE_COSTS", ((1, 1.0), (2, 1.0)))
    monkeypatch.setattr(spec_policy, "DEFAULT_MIN_GAIN", 0.0)


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {arch: write_tiny_checkpoint(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_loaded(tiny_paths) -> Callable[[str], LoadedModel]:
    """Loaded models, once per arch; engines share them (each owns its KV caches)."""
    cache: dict[str, LoadedModel] = {}

    def get(arch: str) -> LoadedModel:
        if arch not in cache:
            cache[arch] = load_model(str(tiny_paths[arch]))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hf_reference(tiny_paths) -> Callable[[str, list[int], int], list[int]]:
    """Greedy continuation from ``transformers.generate`` (no EOS stop), memoized."""
    models: dict[str, torch.nn.Module] = {}
    memo: dict[tuple, list[int]] = {}

    def ref(arch: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (arch, tuple(prompt_ids), max_new_tokens)
        if key not in memo:
            if arch not in models:
                models[arch] = AutoModelForCausalLM.from_pretrained(tiny_paths[arch], dtype=torch.float32).eval()
            memo[key] = hf_greedy(models[arch], prompt_ids, max_new_tokens)
        return memo[key]

    return ref
