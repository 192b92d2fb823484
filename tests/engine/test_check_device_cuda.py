"""check_device's CUDA branches, on a CPU-only build: torch's CUDA queries are
replaced by what a CUDA build would answer."""

from __future__ import annotations

import pytest
import torch

from omnistage.engine.arg_utils import check_device


@pytest.fixture
def cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")

    def visible(count):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return visible


def test_cuda_build_with_devices_accepts_each_visible_index(cuda_build):
    cuda_build(2)
    check_device("cuda")
    check_device("cuda:1")
    with pytest.raises(ValueError, match=r"device='cuda:2': only 2 CUDA device\(s\) are visible"):
        check_device("cuda:2")


def test_cuda_build_without_visible_devices_is_refused(cuda_build):
    cuda_build(0)
    with pytest.raises(ValueError, match="no CUDA device is visible to this process"):
        check_device("cuda")
