"""Fixtures shared across test directories."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's tests with one intra-op thread.

    Tiny models gain nothing from intra-op threads, and on a busy shared
    2-core machine the thread barriers cost more than the math (the token2wav
    DiT and vocoder run ~50x slower with 2). Module scope: the setting is
    restored before other modules' tests run.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
