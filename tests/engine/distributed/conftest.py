"""A local Ray instance for the distributed-engine tests, once per session.

Sized for a 2-core machine: 4 logical CPUs (replicas ask for one each, so two
engines' replicas fit), no dashboard. A Ray instance someone else started in
this process (another test package's fixture) is used as it is.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray


@pytest.fixture(scope="session")
def local_ray() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
