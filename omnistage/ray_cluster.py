"""The one way omnistage connects to Ray (data-parallel replicas, encoder workers).

``connect_ray()`` is a no-op when this process is connected already (a
script's own ``ray.init``, or inside a Ray actor); else it joins the cluster
``RAY_ADDRESS`` names, or starts a local instance when that is unset (never a
cluster found by chance on the machine, see ``envs.ray_address``). Named
actors (the encoder workers every engine of a checkpoint shares) live in
``RAY_NAMESPACE``.
"""

from __future__ import annotations

import threading

from omnistage import envs

__all__ = ["RAY_NAMESPACE", "actor_resources", "connect_ray"]

RAY_NAMESPACE = "omnistage"


def actor_resources(device: str) -> dict[str, int]:
    """What an actor running a model on ``device`` reserves: a GPU for ``cuda``/``cuda:N``
    (Ray then sets its ``CUDA_VISIBLE_DEVICES``), else one CPU."""
    return {"num_gpus": 1} if device.startswith("cuda") else {"num_cpus": 1}


def _init() -> None:
    import ray

    ray.init(address=envs.ray_address(), namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False)


def connect_ray() -> None:
    """Connect this process to Ray unless it is already.

    A local instance's processes die with the thread that started them (Ray
    sets PR_SET_PDEATHSIG, which Linux ties to the parent thread), and the
    server builds its engine in a thread that ends on a rebuild; so off the
    main thread Ray is started from a daemon thread that lives as long as the
    process."""
    import ray

    if ray.is_initialized():
        return
    if threading.current_thread() is threading.main_thread():
        _init()
        return
    started: list[BaseException | None] = []
    done = threading.Event()

    def keep() -> None:
        try:
            _init()
            started.append(None)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            started.append(exc)
        done.set()
        if started[0] is None:
            threading.Event().wait()  # hold the instance's processes for the life of the process

    threading.Thread(target=keep, name="omnistage-ray", daemon=True).start()
    done.wait()
    if started[0] is not None:
        raise started[0]
