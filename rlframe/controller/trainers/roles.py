"""Worker groups of a run, placed as the config says: all roles colocated in one pool (the hybrid
engine: one process per rank hosts actor + rollout, critic and reference) or split across pools."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from rlframe.config.resources import needs_reference
from rlframe.config.schedule import optimizer_steps
from rlframe.config.schema import RunConfig
from rlframe.config.resources import has_reference_group, role_world_sizes
from rlframe.single_controller import RayWorkerGroup, ResourcePool, RoleSpec
from rlframe.single_controller.dispatch import METRICS_KEY
from rlframe.controller.lifecycle.prelaunch import hybrid_pool, role_pool, take_hosts, worker_env
from rlframe.protocol import DataProto
from rlframe.utils import trace
from rlframe.workers.actor import ActorWorker
from rlframe.workers.critic import CriticWorker
from rlframe.workers.generator import GeneratorWorker
from rlframe.workers.reference import ReferenceWorker
from rlframe.workers.reward_model import RewardModelWorker


@dataclass
class RunRoles:
    actor: RayWorkerGroup
    critic: RayWorkerGroup | None
    ref: RayWorkerGroup | None
    reward_model: RayWorkerGroup | None
    pools: list[ResourcePool]
    rollout_tp: int = 1
    generator: RayWorkerGroup | None = None  # split placement: vLLM in its own group

    @property
    def replicas(self) -> int:
        """Generation replicas: the generating group's processes / rollout tp."""
        return (self.generator or self.actor).world_size // self.rollout_tp

    def generate_sequences(self, prompts: DataProto, *, blocking: bool = True, push: bool = True):
        """Generate with the current policy. Hybrid engine: the actor reshards into its own vLLM
        inside the call. Split: the actor group first sends new weights to the generation group, both
        groups working at once, and the sync's metrics join the generation's. blocking=False returns
        a future (`.get()`): the generation group works while the driver goes on. push=False
        generates with whatever weights the generation group holds (asynchronous training decides)."""
        if self.generator is None:
            return self.actor.generate_sequences(prompts, blocking=blocking)
        sync = self.push_weights() if push else {}  # first: the generation group runs its calls in order
        pending = _MergedMetrics(self.generator.generate_sequences(prompts, blocking=False), sync)
        return pending.get() if blocking else pending

    def push_weights(self) -> dict[str, float]:
        """Split placement: after an update, training shards go straight into the generation group's
        vLLM over the channel (`send_weights` and `receive_weights` run together)."""
        if not self.weights_pending():
            return {}
        t0 = time.perf_counter()
        with trace.span("push_weights"):  # trainer.trace: the driver's side of the push
            sending = self.actor.send_weights(blocking=False)
            receiving = self.generator.receive_weights(blocking=False)
            sent, received = sending.get(), receiving.get()
        self._generator_has_weights = True
        out = {k: max(r[k] for r in sent) for k in sent[0]}
        out.update({k: max(r[k] for r in received) for k in received[0]})
        out["timing_s/update_weights"] = time.perf_counter() - t0
        return out

    def weights_pending(self) -> bool:
        """Split placement: the generation group needs a push before it generates (the actor was updated
        since the last one, or the group started with dummy weights and was never pushed to)."""
        if any(self.actor.weights_stale()):
            return True
        if self._generator_has_weights:
            return False
        self._generator_has_weights = not any(self.generator.awaits_full_sync())
        return not self._generator_has_weights

    def memory(self) -> dict[str, float]:
        """Per role, MB, the max over its ranks: the peak resident memory of its processes
        (`memory/rss_mb/<role>`; colocated roles share theirs) and its model's parameters, gradient
        buffers and optimizer state (`memory/{params,grads,optimizer,state}_mb/<role>`)."""
        groups = {"actor": self.actor, "critic": self.critic, "ref": self.ref, "reward_model": self.reward_model,
                  "rollout": self.generator}
        pending = {name: group.peak_memory(blocking=False) for name, group in groups.items() if group is not None}
        out = {}
        for name, future in pending.items():
            ranks = future.get()
            for key in {k for r in ranks for k in r}:  # a rank whose state was not counted has rss_mb only
                out[f"memory/{key}/{name}"] = max(r[key] for r in ranks if key in r)
        return out

    _generator_has_weights = False  # once true it stays true: only a sleep drops weights, and it never sleeps

    def shutdown(self) -> None:
        seen = set()
        for group in (self.actor, self.critic, self.ref, self.reward_model, self.generator):
            if group is not None and id(group.hosts) not in seen:
                seen.add(id(group.hosts))
                group.shutdown()
        for pool in self.pools:
            pool.release()


class _MergedMetrics:
    """A generation future whose result carries the weight push's metrics as one more row."""

    def __init__(self, future, sync: dict[str, float]):
        self.future, self.sync = future, sync

    def get(self) -> DataProto:
        out = self.future.get()
        if self.sync:
            out.meta_info[METRICS_KEY] = list(out.meta_info.get(METRICS_KEY) or []) + [self.sync]
        return out


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
    max_len = cfg.max_model_len
    # Dr. GRPO's seq-mean-token-sum-norm divides by a constant: the maximum response length.
    algorithm = dataclasses.replace(cfg.algorithm, loss_scale_factor=cfg.algorithm.loss_scale_factor
                                    or float(cfg.data.response_length))
    split = cfg.resources.placement == "split"  # generation in its own group, not the actor's processes
    specs = {"actor": RoleSpec(worker_class(cfg.actor.worker_cls, ActorWorker), kwargs=dict(
        model_path=actor_path, actor=cfg.actor, algorithm=algorithm, rollout=None if split else cfg.rollout,
        max_model_len=max_len, total_steps=optimizer_steps(cfg, cfg.actor, actor=True), seed=cfg.trainer.seed))}
    if split:
        specs["rollout"] = RoleSpec(GeneratorWorker, kwargs=dict(model_path=actor_path, rollout=cfg.rollout,
                                                                 max_model_len=max_len, seed=cfg.trainer.seed,
                                                                 actor=cfg.actor))
    if cfg.uses_critic:
        specs["critic"] = RoleSpec(worker_class(cfg.critic.worker_cls, CriticWorker), kwargs=dict(
            model_path=critic_path, critic=cfg.critic, loss_agg_mode=cfg.algorithm.loss_agg_mode or "token-mean",
            loss_scale_factor=algorithm.loss_scale_factor, total_steps=optimizer_steps(cfg, cfg.critic),
            seed=cfg.trainer.seed))
    # with LoRA the actor is its own reference (adapters off): no second copy of the weights
    if has_reference_group(cfg):
        specs["ref"] = RoleSpec(ReferenceWorker, kwargs=dict(model_path=actor_path, layout=cfg.actor,
                                                             seed=cfg.trainer.seed))
    return specs


def build_roles(cfg: RunConfig, *, actor_path: str, critic_path: str) -> RunRoles:
    specs = role_specs(cfg, actor_path=actor_path, critic_path=critic_path)
    env = worker_env(cfg)
    timeout = cfg.trainer.collective_timeout_s
    if cfg.resources.placement == "colocated":
        pool, hosts = take_hosts(cfg, "hybrid") or (hybrid_pool(cfg), None)
        groups = RayWorkerGroup.colocated(pool, specs, name="hybrid", env=env, collective_timeout_s=timeout,
                                          hosts=hosts)
        pools = [pool]
    else:
        sizes = role_world_sizes(cfg)
        groups, pools = {}, []
        for role, spec in specs.items():
            pool = role_pool(cfg, sizes[role], role)
            groups[role] = RayWorkerGroup(pool, spec.cls, name=role, kwargs=spec.kwargs, env=env,
                                          collective_timeout_s=timeout)
            pools.append(pool)
    rm = None
    if cfg.reward.model_paths:
        pool = role_pool(cfg, cfg.resources.procs_per_node, "reward_model")
        rm = RayWorkerGroup(pool, RewardModelWorker, name="reward_model",
                            kwargs=dict(model_paths=cfg.reward.model_paths, ensemble=cfg.reward.ensemble,
                                        policy_tokenizer_path=actor_path), env=env,
                            collective_timeout_s=timeout)
        pools.append(pool)
    ref = groups.get("ref")
    if ref is None and needs_reference(cfg):
        ref = groups["actor"]  # LoRA: ActorWorker.compute_ref_log_prob, the base model with adapters off
    roles = RunRoles(actor=groups["actor"], critic=groups.get("critic"), ref=ref,
                     reward_model=rm, pools=pools, rollout_tp=cfg.rollout.tp, generator=groups.get("rollout"))
    if roles.generator is not None:
        open_weight_channel(roles.actor, roles.generator, gen_tp=cfg.rollout.tp, bucket_bytes=cfg.rollout.bucket_bytes,
                            timeout_s=timeout, delta_full_every=cfg.rollout.delta_syncs(),
                            transport=cfg.rollout.weight_transport, directory=cfg.rollout.weight_transport_dir,
                            chain=cfg.rollout.weight_fanout == "chain", backend=cfg.rollout.backend)
    return roles


def open_weight_channel(actor: RayWorkerGroup, generator: RayWorkerGroup, *, gen_tp: int, bucket_bytes: int,
                        timeout_s: float, delta_full_every: int | None = None, transport: str = "gloo",
                        directory: str | None = None, chain: bool = False, backend: str = "auto") -> None:
    """Join every process of both groups in the weight channel (rendezvous on the actor's rank 0)
    and let each side plan the same sync (delta syncs when `delta_full_every` is set) into the slices
    the generation group's rollout `backend` holds."""
    import ray

    addr, port = ray.get(actor.hosts.actors[0].address.remote())
    metas, layout = actor.weight_plan_inputs()[0]
    common = dict(addr=addr, port=port, bucket_bytes=bucket_bytes, timeout_s=timeout_s,
                  delta_full_every=delta_full_every, transport=transport, directory=directory, chain=chain,
                  blocking=False)
    joining = [actor.join_weight_channel(backend=backend, gen_tp=gen_tp, gen_world=generator.world_size, **common),
               generator.join_weight_channel(train_layout=layout, metas=metas, **common)]
    for fut in joining:
        fut.get()
