"""Fixtures for the Qwen3-Omni pipeline tests: one tiny checkpoint, loaded once for
omnistage (engines share it) and once for transformers (the reference)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omnistage import LLM
from omnistage.models.qwen3_omni import Qwen3OmniModel, load_qwen3_omni
from omnistage.testing.tiny_qwen3_omni_checkpoint import write_tiny_qwen3_omni

transformers = pytest.importorskip("transformers")

# Block size 4 makes short prompts span several full blocks, so prefix hits are real.
SMALL = {
    "block_size": 4,
    "max_model_len": 256,
    "num_kv_blocks": 256,
    "talker_max_model_len": 320,
    "max_num_seqs": 8,
}
GREEDY_TALKER = {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 10}


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # the shared CPU: many threads are slower here


@pytest.fixture(scope="session")
def q3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers.logging.set_verbosity_error()
    return write_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_qwen3_omni"))


@pytest.fixture(scope="session")
def q3_model(q3_dir: Path) -> Qwen3OmniModel:
    return load_qwen3_omni(q3_dir)


@pytest.fixture(scope="session")
def q3_hf(q3_dir: Path) -> Any:
    return transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        q3_dir
    ).eval()


@pytest.fixture(scope="session")
def make_q3(q3_model: Qwen3OmniModel) -> Callable[..., LLM]:
    """An ``LLM`` on the shared weights; keyword arguments override ``SMALL`` and a greedy talker."""

    def make(**kwargs: Any) -> LLM:
        return LLM(
            q3_model, **{**SMALL, "talker_params": dict(GREEDY_TALKER), **kwargs}
        )

    return make
