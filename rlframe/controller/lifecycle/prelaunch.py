"""Start-up stages that overlap: the driver's heavy imports while Ray starts, and the worker
processes' own start (a Python process importing torch, transformers, vLLM and the worker classes)
while the driver loads the tokenizer and the data.

    run_training:  importer = import_in_background(trainer_class, cfg)   # a thread
                   start Ray                                             # main thread, meanwhile
                   launch_hosts(cfg)      # worker processes start, nobody waits for them yet
                   trainer_cls = importer.result()
    trainer:       tokenizer, data ...    # the processes start meanwhile
    build_roles:   taken = take_hosts(cfg, "hybrid")  -> join them, place the roles

Only colocated placement (one set of processes for all roles) is launched early; split placement
starts its groups in build_roles. Processes launched and never taken (the trainer failed before
placing its roles) are stopped by `discard_launched()`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from rlframe.config.resources import node_groups
from rlframe.config.schema import RunConfig
from rlframe.single_controller.resource_pool import ResourcePool
from rlframe.single_controller.worker_group import HostSet

_launched: dict[tuple[str, str], tuple[ResourcePool, HostSet]] = {}


def import_in_background(fn: Callable, *args) -> Future:
    """Run `fn(*args)` on a thread; the future's result() waits for it and re-raises what it raised."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlframe-import")
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with fn; nothing else is submitted
    return future


def role_pool(cfg: RunConfig, procs: int, name: str) -> ResourcePool:
    """The pool of `procs` processes for group `name` (its per-node groups: config/resources.node_groups)."""
    return ResourcePool(procs_per_node=node_groups(cfg, procs), use_gpu=cfg.resources.use_gpu,
                        cpus_per_proc=cfg.resources.cpus_per_proc, name=name)


def hybrid_pool(cfg: RunConfig) -> ResourcePool:
    """The pool of a colocated run: every process of every node, shared by all roles."""
    return role_pool(cfg, cfg.resources.nodes * cfg.resources.procs_per_node, "hybrid")


def worker_env(cfg: RunConfig) -> dict[str, str]:
    """Environment every worker process of the run gets."""
    return {"RLFRAME_RUN": cfg.trainer.experiment, "RLFRAME_IMPORTS": ",".join(cfg.imports)}


def launch_hosts(cfg: RunConfig) -> None:
    """Start the processes of a colocated run now, without waiting for them."""
    if cfg.resources.placement != "colocated":
        return
    pool = hybrid_pool(cfg)
    hosts = HostSet(pool, name="hybrid", env=worker_env(cfg), collective_timeout_s=cfg.trainer.collective_timeout_s,
                    join=False)
    _launched[(cfg.trainer.experiment, "hybrid")] = (pool, hosts)


def run_hosts(cfg: RunConfig) -> list[str]:
    """"hostname (ip)" of each node the run's processes go to: the nodes its launched processes were
    placed on (colocated), else (split placement: placed later) the Ray cluster's alive nodes."""
    from rlframe.single_controller.resource_pool import node_hosts

    launched = _launched.get((cfg.trainer.experiment, "hybrid"))
    return node_hosts(launched[0].node_ids() if launched is not None else None)


def take_hosts(cfg: RunConfig, name: str) -> tuple[ResourcePool, HostSet] | None:
    """The (pool, processes) launched for group `name` of this run, once; None if none were."""
    return _launched.pop((cfg.trainer.experiment, name), None)


def discard_launched() -> None:
    """Stop the processes launched and never taken, and free their pools."""
    while _launched:
        _, (pool, hosts) = _launched.popitem()
        hosts.shutdown()
        pool.release()
