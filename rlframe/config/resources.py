"""What a run asks of its Ray cluster, checked before any worker is placed.

A placement group that cannot be satisfied waits (60 s) and then fails with a Ray error far from
the config key that caused it, so the driver compares the bundles it will ask for with what the
cluster has: before Ray starts for a private cluster (this machine), and right after joining for an
existing one (`ray.address` / RAY_ADDRESS). Each message names the key and what the cluster has.
"""

from __future__ import annotations

import os

from rlframe.config.schema import RunConfig


def role_world_sizes(cfg: RunConfig) -> dict[str, int]:
    """Processes of each worker group (colocated: all roles share the whole pool)."""
    res = cfg.resources
    total = res.nodes * res.procs_per_node
    if res.placement == "colocated":
        return {"actor": total, "critic": total, "ref": total}
    split = res.split_procs or {}
    actor = int(split.get("actor", total))
    return {"actor": actor, "critic": int(split.get("critic", actor)), "ref": int(split.get("ref", actor)),
            "rollout": int(split.get("rollout", actor))}


def process_count(cfg: RunConfig) -> int:
    """Worker processes the run starts: the whole pool when colocated; with split placement the sum of
    the groups it builds (actor, rollout, and critic / reference when the run has them:
    controller/trainers/roles.py), e.g. 4 for PPO with split_procs {actor: 1, rollout: 1}."""
    res = cfg.resources
    if res.placement == "colocated":
        return res.nodes * res.procs_per_node
    sizes = role_world_sizes(cfg)
    roles = ["actor", "rollout"] + (["critic"] if cfg.uses_critic else []) + (["ref"] if has_reference_group(cfg) else [])
    return sum(sizes[r] for r in roles)


def needs_reference(cfg: RunConfig) -> bool:
    """Whether the run computes a reference policy's log-probs: a KL term, or an algorithm whose spec
    scores pairs against one (online DPO)."""
    from rlframe.config.algorithms import algorithm_spec, known

    return cfg.uses_ref or (known(cfg.algorithm) and algorithm_spec(cfg.algorithm).pairs)


def has_reference_group(cfg: RunConfig) -> bool:
    """Whether the run builds a reference worker group (with LoRA the actor is its own reference)."""
    return needs_reference(cfg) and cfg.actor.lora_rank == 0


def generation_group(cfg: RunConfig) -> str:
    """The group whose processes generate: the actor's (colocated, the hybrid engine) or its own (split)."""
    return "rollout" if cfg.resources.placement == "split" else "actor"


def joins_existing_cluster(cfg: RunConfig) -> str | None:
    """The address the run joins (config first, then RAY_ADDRESS), or None for a private Ray."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or None


def private_num_cpus(cfg: RunConfig) -> int:
    """Logical CPUs of a private Ray: at least 16, since ranks mostly wait on each other and a
    2-core laptop must still place a group of 4-8 ranks (one bundle each)."""
    return cfg.ray.num_cpus or max(16, os.cpu_count() or 1)


def node_groups(cfg: RunConfig, procs: int) -> list[int]:
    """The per-node groups of a pool of `procs` processes: all on one node when the run has one node,
    else nodes of resources.procs_per_node (and the rest), each group on a node of its own."""
    per_node = cfg.resources.procs_per_node
    if cfg.resources.nodes == 1:
        return [procs]
    return [per_node] * (procs // per_node) + ([procs % per_node] if procs % per_node else [])


def pool_sizes(cfg: RunConfig) -> dict[str, int]:
    """Processes of each resource pool the run creates (see controller/trainers/roles.py)."""
    res = cfg.resources
    if res.placement == "colocated":
        pools = {"hybrid": res.nodes * res.procs_per_node}
    else:
        sizes = role_world_sizes(cfg)
        pools = {"actor": sizes["actor"], "rollout": sizes["rollout"]}
        if cfg.uses_critic:
            pools["critic"] = sizes["critic"]
        if has_reference_group(cfg):
            pools["ref"] = sizes["ref"]
    if cfg.reward.model_paths:
        pools["reward_model"] = res.procs_per_node
    return pools


def required(cfg: RunConfig) -> dict[str, float]:
    procs = sum(pool_sizes(cfg).values())
    need = {"CPU": procs * cfg.resources.cpus_per_proc}
    if cfg.resources.use_gpu:
        need["GPU"] = float(procs)
    return need


def _shortfalls(cfg: RunConfig, have: dict[str, float], where: str) -> list[str]:
    need, out = required(cfg), []
    pools = ", ".join(f"{k} {v}" for k, v in pool_sizes(cfg).items())
    if need.get("GPU", 0) > have.get("GPU", 0):
        out.append(f"resources.use_gpu=true needs {need['GPU']:g} GPUs (one per process: {pools}), but {where} "
                   f"has {have.get('GPU', 0):g} GPUs and {have.get('CPU', 0):g} logical CPUs; set "
                   "resources.use_gpu=false to run on CPU, or run where the GPUs are")
    if need["CPU"] > have.get("CPU", 0):
        out.append(f"the run needs {need['CPU']:g} logical CPUs (resources.cpus_per_proc="
                   f"{cfg.resources.cpus_per_proc:g} x processes: {pools}), but {where} has "
                   f"{have.get('CPU', 0):g}; lower resources.cpus_per_proc or resources.procs_per_node"
                   + (", or raise ray.num_cpus" if where.startswith("this machine") else ""))
    return out


def check_private_cluster(cfg: RunConfig) -> list[str]:
    """Problems a private Ray on this machine would only find after a placement timeout."""
    if joins_existing_cluster(cfg):
        return []
    if cfg.resources.nodes > 1:
        return [f"resources.nodes={cfg.resources.nodes} needs a multi-node Ray cluster, but with ray.address "
                "null and no RAY_ADDRESS the run starts a private Ray on this one machine; set "
                "ray.address=auto (the cluster `ray start` made here) or its ip:port, or resources.nodes=1"]
    have = {"CPU": float(private_num_cpus(cfg)), "GPU": float(_local_gpus())}
    return _shortfalls(cfg, have, "this machine (a private Ray)")


def check_joined_cluster(cfg: RunConfig, cluster_resources: dict[str, float]) -> list[str]:
    """The same comparison against a running cluster's `ray.cluster_resources()`."""
    return _shortfalls(cfg, cluster_resources, "the Ray cluster")


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA runtime counts as no GPU
        return 0
