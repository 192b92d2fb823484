"""Fixtures for the omni pipeline tests: one tiny Qwen2.5-Omni checkpoint, loaded
once for omnistage (engines share it) and once for transformers (the reference)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from omnistage.models.qwen2_5_omni import OmniModel, load_qwen2_5_omni
from omnistage import LLM
from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni
from omni_utils import GREEDY_TALKER, SMALL

transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="session")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers.logging.set_verbosity_error()
    return write_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny_omni_pipeline"))


@pytest.fixture(scope="session")
def omni_model(omni_dir: Path) -> OmniModel:
    return load_qwen2_5_omni(omni_dir)


@pytest.fixture(scope="session")
def hf_model(omni_dir: Path) -> Any:
    return transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir).eval()


@pytest.fixture(scope="session")
def make_llm(omni_model: OmniModel) -> Callable[..., LLM]:
    """An ``LLM`` on the shared omni weights; keyword arguments override ``SMALL``
    and a greedy talker."""

    def make(**kwargs: Any) -> LLM:
        args = {**SMALL, "talker_params": dict(GREEDY_TALKER), **kwargs}
        return LLM(omni_model, **args)

    return make
