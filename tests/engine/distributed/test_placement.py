"""Where Ray places omnistage's actors (replicas, encoder workers), checked without Ray or a GPU."""

from __future__ import annotations

import pytest

from omnistage.ray_cluster import actor_resources


@pytest.mark.parametrize(("device", "want"), [("cuda", {"num_gpus": 1}), ("cuda:1", {"num_gpus": 1}), ("cpu", {"num_cpus": 1})])
def test_actors_reserve_a_gpu_for_cuda_and_a_cpu_otherwise(device, want):
    assert actor_resources(device) == want
