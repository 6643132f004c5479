"""Starting or joining Ray from the driver.

The rule (docs/ray.md): a run joins an existing Ray cluster only when asked, by `ray.address` in
the config or the RAY_ADDRESS environment variable (set by Ray for submitted jobs). Otherwise it
starts a private Ray for itself (`ray.init(address="local")`), also when another cluster runs on
the machine: plain `ray.init()` would join the cluster `ray start --head` left in
/tmp/ray/ray_current_cluster, and then refuses the CPU count a private Ray needs.
"""

from __future__ import annotations

import os

# Task arguments and results up to this size travel inside Ray's task messages instead of through
# its object store (Ray's default is 100 KiB). A group call's per-rank DataProto chunks and the
# rollouts they return are a few hundred KiB on small models: the demo step's driver overhead
# 0.020 -> 0.015 s. Applies to the private Ray started here; a joined cluster keeps its own setting.
INLINE_TASK_BYTES = 1 << 20

# What the private Ray is started with. Ray prestarts idle Python workers when the first driver
# connects; rlframe's worker groups are actors that never take one, so on a small machine those
# processes only compete with the run's own start-up for the cores: on 2 cores the default job's
# start-up went 60 s -> 49-55 s without them (docs/benchmarks.md, "Control plane").
PRIVATE_RAY_SYSTEM_CONFIG = {"max_direct_call_object_size": INLINE_TASK_BYTES,
                             "prestart_worker_first_driver": False}


def resolve_address(address: str | None) -> str | None:
    """The cluster to join: `address`, else RAY_ADDRESS; None (or "") means a private Ray."""
    return address or os.environ.get("RAY_ADDRESS") or None


def init_local_ray(*, address: str | None = None, num_cpus: int | None = None, quiet: bool = True,
                   runtime_env: dict | None = None):
    """Join the cluster at `address` (or RAY_ADDRESS), else start a private local Ray.

    A private Ray advertises at least 16 logical CPUs: worker processes mostly wait on each other,
    and a 2-core laptop must still be able to place a group of 4-8 ranks (one bundle each).
    """
    import ray

    if ray.is_initialized():
        return ray
    kwargs = {"ignore_reinit_error": True, "log_to_driver": not quiet, "runtime_env": runtime_env}
    address = resolve_address(address)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(address="local", num_cpus=num_cpus or max(16, os.cpu_count() or 1), include_dashboard=False,
                 _system_config=PRIVATE_RAY_SYSTEM_CONFIG, **kwargs)
    return ray


def start_ray_for_run(cfg, *, runtime_env: dict | None = None):
    """Start or join Ray as `cfg.ray` says, then check the cluster can place the run's worker
    groups (a joined cluster is only known once joined); ConfigError naming the keys otherwise."""
    from rlframe.config.resources import check_joined_cluster, private_num_cpus
    from rlframe.config.validate import ConfigError

    ray = init_local_ray(address=cfg.ray.address, num_cpus=private_num_cpus(cfg), runtime_env=runtime_env)
    problems = check_joined_cluster(cfg, ray.cluster_resources())
    if problems:
        raise ConfigError(problems)
    return ray
