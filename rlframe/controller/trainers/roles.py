"""Worker groups of a run, placed as the config says: all roles colocated in one pool (the hybrid
engine: one process per rank hosts actor + rollout, critic and reference) or split across pools."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlframe.config.schema import RunConfig
from rlframe.config.validate import role_world_sizes
from rlframe.controller import RayWorkerGroup, ResourcePool, RoleSpec
from rlframe.workers.actor import ActorWorker
from rlframe.workers.critic import CriticWorker
from rlframe.workers.reference import ReferenceWorker
from rlframe.workers.reward_model import RewardModelWorker


@dataclass
class RunRoles:
    actor: RayWorkerGroup
    critic: RayWorkerGroup | None
    ref: RayWorkerGroup | None
    reward_model: RayWorkerGroup | None
    pools: list[ResourcePool]

    def shutdown(self) -> None:
        seen = set()
        for group in (self.actor, self.critic, self.ref, self.reward_model):
            if group is not None and id(group.hosts) not in seen:
                seen.add(id(group.hosts))
                group.shutdown()
        for pool in self.pools:
            pool.release()


def worker_class(target: str | None, default: type) -> type:
    """The configured subclass of a role's worker, or the built-in one."""
    if target is None:
        return default
    from rlframe.config.validate import load_class

    cls = load_class(target)
    if not issubclass(cls, default):
        raise ValueError(f"{target} must subclass {default.__module__}.{default.__name__} (it replaces that role)")
    return cls


def role_specs(cfg: RunConfig, *, actor_path: str, critic_path: str) -> dict[str, RoleSpec]:
    total = cfg.trainer.total_steps * max(1, cfg.actor.ppo_epochs)
    max_len = cfg.data.prompt_length + cfg.data.response_length
    # Dr. GRPO's seq-mean-token-sum-norm divides by a constant: the maximum response length.
    algorithm = dataclasses.replace(cfg.algorithm, loss_scale_factor=cfg.algorithm.loss_scale_factor
                                    or float(cfg.data.response_length))
    specs = {"actor": RoleSpec(worker_class(cfg.actor.worker_cls, ActorWorker), kwargs=dict(
        model_path=actor_path, actor=cfg.actor, algorithm=algorithm, rollout=cfg.rollout,
        max_model_len=max_len, total_steps=total, seed=cfg.trainer.seed))}
    if cfg.uses_critic:
        specs["critic"] = RoleSpec(worker_class(cfg.critic.worker_cls, CriticWorker), kwargs=dict(
            model_path=critic_path, critic=cfg.critic, loss_agg_mode=cfg.algorithm.loss_agg_mode or "token-mean",
            total_steps=total, seed=cfg.trainer.seed))
    if cfg.uses_ref or cfg.algorithm.name == "online_dpo":
        specs["ref"] = RoleSpec(ReferenceWorker, kwargs=dict(model_path=actor_path, layout=cfg.actor,
                                                             seed=cfg.trainer.seed))
    return specs


def _pool(cfg: RunConfig, procs: int, name: str) -> ResourcePool:
    per_node = cfg.resources.procs_per_node
    nodes = [per_node] * (procs // per_node) + ([procs % per_node] if procs % per_node else [])
    return ResourcePool(procs_per_node=nodes, use_gpu=cfg.resources.use_gpu,
                        cpus_per_proc=cfg.resources.cpus_per_proc, name=name)


def build_roles(cfg: RunConfig, *, actor_path: str, critic_path: str) -> RunRoles:
    specs = role_specs(cfg, actor_path=actor_path, critic_path=critic_path)
    env = {"RLFRAME_RUN": cfg.trainer.experiment, "RLFRAME_IMPORTS": ",".join(cfg.imports)}
    timeout = cfg.trainer.collective_timeout_s
    if cfg.resources.placement == "colocated":
        pool = _pool(cfg, cfg.resources.nodes * cfg.resources.procs_per_node, "hybrid")
        groups = RayWorkerGroup.colocated(pool, specs, name="hybrid", env=env, collective_timeout_s=timeout)
        pools = [pool]
    else:
        sizes = role_world_sizes(cfg)
        groups, pools = {}, []
        for role, spec in specs.items():
            pool = _pool(cfg, sizes[role], role)
            groups[role] = RayWorkerGroup(pool, spec.cls, name=role, kwargs=spec.kwargs, env=env,
                                          collective_timeout_s=timeout)
            pools.append(pool)
    rm = None
    if cfg.reward.model_paths:
        pool = _pool(cfg, cfg.resources.procs_per_node, "reward_model")
        rm = RayWorkerGroup(pool, RewardModelWorker, name="reward_model",
                            kwargs=dict(model_paths=cfg.reward.model_paths, ensemble=cfg.reward.ensemble), env=env,
                            collective_timeout_s=timeout)
        pools.append(pool)
    return RunRoles(actor=groups["actor"], critic=groups.get("critic"), ref=groups.get("ref"),
                    reward_model=rm, pools=pools)
