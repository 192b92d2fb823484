"""Fixtures shared across test directories."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

# Hypothesis profiles for the property tests (tests/*/test_properties_*.py).
# "ci" (the default) is derandomized, so every run explores the same cases and a
# failure reproduces; it keeps those files under a minute together. For a longer
# search with fresh random cases run e.g.
#   HYPOTHESIS_PROFILE=long python -m pytest tests/core/test_properties_kv.py
settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("long", max_examples=1000, stateful_step_count=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for every test that needs one (data-parallel
    replicas, encoder workers), started on first use. Logical CPUs, not
    cores: each replica or encoder worker asks for one, and the tests keep up
    to a handful alive at once on a 2-core machine. A Ray instance someone
    else started in this process is used as it is."""
    ray = pytest.importorskip("ray")
    from omnistage.ray_cluster import RAY_NAMESPACE

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, namespace=RAY_NAMESPACE, include_dashboard=False,
                 object_store_memory=256 * 2**20, log_to_driver=False)  # fmt: skip
    yield ray
    if started:
        ray.shutdown()


# Speculating engines in tests keep the draft policy's built-in step-cost curve, so
# every run drafts the same way on any machine; tests/worker/test_step_costs.py
# measures it, and turns this off where it does.
os.environ.setdefault("OMNISTAGE_MEASURE_STEP_COST", "0")
