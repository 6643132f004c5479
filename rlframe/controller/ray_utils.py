"""Starting or joining Ray from the driver."""

from __future__ import annotations

import os


def init_local_ray(*, address: str | None = None, num_cpus: int | None = None, quiet: bool = True,
                   runtime_env: dict | None = None):
    """Join the cluster at `address` (or RAY_ADDRESS), else start a local Ray.

    A local Ray advertises at least 16 logical CPUs: worker processes mostly wait on each other,
    and a 2-core laptop must still be able to place a group of 4-8 ranks (one bundle each).
    """
    import ray

    if ray.is_initialized():
        return ray
    kwargs = {"ignore_reinit_error": True, "log_to_driver": not quiet, "runtime_env": runtime_env}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus or max(16, os.cpu_count() or 1), include_dashboard=False,
                 **kwargs)
    return ray
