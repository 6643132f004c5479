"""`trainer.dry_run=true`: print placement, layouts, the resharding plan and a memory estimate.

Runs on a laptop for any cluster config: it needs only the model's shapes (from `model.hf_config`,
the `config.json` at `model.path`, or the tiny preset), never weights, GPUs or Ray. The memory
table is `memory_estimate.py`'s, a column per pipeline stage (or group, with split placement).
"""

from __future__ import annotations

import json
from math import prod
from pathlib import Path

from rlframe.plugins import engine_spec
from rlframe.config.schema import RunConfig
from rlframe.config.resources import process_count, role_world_sizes
from rlframe.plan.memory_estimate import GiB, Estimate, train_layout, training_roles
from rlframe.resharding.formats import ModelDims, hf_param_shapes
from rlframe.resharding.layout import Layout, generation_layout
from rlframe.resharding.planner import ParamMeta, plan_reshard
from rlframe.workers.weight_plan import split_generation_layout


def model_dims(cfg: RunConfig) -> ModelDims:
    """Shapes of the actor model without loading weights."""
    return ModelDims.from_hf_config(ModelDims.config_namespace(model_config(cfg)))


def model_config(cfg: RunConfig) -> dict:
    """The actor model's HF config as a dict (model.hf_config, the checkpoint's config.json, or the
    tiny preset's), without loading weights."""
    raw = cfg.model.hf_config
    if raw is None and cfg.model.path is not None:
        raw = json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text())
    if raw is None:
        from rlframe.data.tiny_model import PRESETS
        from rlframe.data.tokenizer import build_char_tokenizer

        s = PRESETS[cfg.model.tiny_preset]
        raw = {"num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size, "num_attention_heads": s.num_heads,
               "num_key_value_heads": s.num_kv_heads, "intermediate_size": s.intermediate_size,
               "vocab_size": len(build_char_tokenizer()), "model_type": "qwen2"}
    return dict(raw)


def layouts(cfg: RunConfig) -> tuple[Layout, Layout, str]:
    """Training layout of the actor, generation layout, and which scheme maps one to the other."""
    train = train_layout(cfg.actor)
    if cfg.resources.placement == "split":  # the generation group's own ranks, after the actor's
        gen = split_generation_layout(train, tp=cfg.rollout.tp, world=role_world_sizes(cfg)["rollout"])
        return train, gen, "split placement: actor group -> generation group over the weight channel"
    return (train, *generation_layout(train, tp=cfg.rollout.tp))


def runtime_dtype(cfg: RunConfig):
    """The compute dtype the actor's engine and vLLM will use (engines.base.resolve_mixed_precision)."""
    from rlframe.workers.engines.base import precision_dtype

    return precision_dtype(cfg.actor.precision, on_gpu=cfg.resources.use_gpu)


def synced_dtype(cfg: RunConfig):
    """The dtype a weight sync moves: the rollout's, which is the actor engine's compute dtype (the
    actor casts its shards before sending; ActorWorker._synced_metas)."""
    return runtime_dtype(cfg)


def memory_lines(cfg: RunConfig, dims: ModelDims, shapes: dict) -> list[str]:
    """The per-device memory table (a column per pipeline stage or group) and its verdict."""
    est = Estimate(cfg, dims, shapes, runtime_dtype(cfg).itemsize)
    devices = est.devices()
    names = list(dict.fromkeys(name for d in devices for name, _ in d.rows()))
    width = max(len(n) for n in names) + 2
    where = (f"device {est.device_gib:.2f} GiB: {est.device_source}" if cfg.resources.use_gpu else
             "CPU processes: host memory, no verdict")
    cols = [max(10, len(d.label)) + 2 for d in devices]

    def row(name: str, cells) -> str:
        return f"  {name:<{width}}" + "".join("-".rjust(w) if g is None else f"{g:{w}.2f}" for g, w in zip(cells, cols))

    lines = [f"memory estimate per device (GiB; {where}):",
             f"  {'':<{width}}" + "".join(d.label.rjust(w) for d, w in zip(devices, cols))]
    lines += [row(name, [dict(d.rows()).get(name) for d in devices]) for name in names]
    lines.append(row("training phase (+ largest role's step)", [d.training_gib for d in devices]))
    lines.append(row("generation phase (+ vLLM)", [d.generation_gib for d in devices]))
    schedules = sorted({engine_spec(r.cfg.strategy).pipeline_schedule for r in training_roles(cfg) if r.cfg.pp > 1})
    for schedule in filter(None, schedules):
        lines.append(f"  ({schedule}: pipeline stage k keeps the activations of pp - k micro-batches in flight)")
    fits, worst, no_kv = est.verdict(devices)
    if no_kv:
        lines.append(f"  vLLM gets no KV cache: rollout.gpu_memory_utilization * {est.device_gib:.2f} GiB does not "
                     "hold its weights and activation peak; raise gpu_memory_utilization or rollout.tp")
    if cfg.resources.use_gpu:
        verdict = "fits" if fits else ("does NOT fit (raise tp/pp/nodes, turn on activation_checkpointing, lower "
                                       "micro_batch_size or gpu_memory_utilization)")
        which = f"{worst.label} decides: " if len(devices) > 1 else ""
        lines.append(f"  peak: {which}{worst.peak_gib:.2f} GiB of {est.device_gib:.2f}: {verdict}")
    return lines


def _num(x: float) -> str:
    return f"{x:g}"


def algorithm_lines(cfg: RunConfig) -> list[str]:
    """What defines the algorithm beyond its name and estimator (algorithm=dapo, gspo and rloo share
    grpo's or their own estimator and differ here): the policy loss and its clip range, the loss
    aggregation, where the KL to the reference acts and its coefficient, dynamic sampling, overlong
    shaping, and the actor's epochs and mini-batches per step. Indented under the `algorithm:` line."""
    from rlframe.algos.registry import resolve_loss_agg_mode
    from rlframe.config.algorithms import algorithm_spec, known
    from rlframe.config.schedule import rows_per_step

    alg, actor = cfg.algorithm, cfg.actor
    spec = algorithm_spec(alg) if known(alg) else None
    lines = []
    if spec is None or spec.ppo_ratio:
        agg = resolve_loss_agg_mode(policy_loss=alg.policy_loss, loss_agg_mode=alg.loss_agg_mode)
        if agg == "seq-mean-token-sum-norm":
            agg += f" (divided by {_num(alg.loss_scale_factor) if alg.loss_scale_factor else cfg.data.response_length})"
        lines.append(
            f"  policy loss {alg.policy_loss}: ratio clipped to [{_num(1 - alg.clip_ratio_low)}, "
            f"{_num(1 + alg.clip_ratio_high)}] (algorithm.clip_ratio_low {_num(alg.clip_ratio_low)}, clip_ratio_high "
            f"{_num(alg.clip_ratio_high)})" + (f", dual-clip bound c={_num(alg.clip_ratio_c)}" if alg.policy_loss == "dual_clip" else "")
            + f"; loss aggregation {agg}" + (f"; entropy bonus {_num(alg.entropy_coef)}" if alg.entropy_coef else "")
            + (" (algorithm.loss_agg_mode)" if alg.loss_agg_mode else " (the policy loss's own: algorithm.loss_agg_mode=null)"))
    elif spec.pairs:
        lines.append(f"  loss: DPO on pairs of samples against the reference, beta {_num(alg.dpo_beta)} (algorithm.dpo_beta)")
    if spec is None or spec.generates:
        kl = []
        if alg.kl_in_reward:
            how = (f"adaptive to kl_target {_num(alg.kl_target)} over kl_horizon {alg.kl_horizon}" if alg.kl_target is not None
                   else "fixed")
            kl.append(f"in the reward, algorithm.kl_coef {_num(alg.kl_coef)} ({how}), estimator {alg.kl_estimator}")
        if alg.use_kl_loss:
            kl.append(f"in the loss, algorithm.kl_loss_coef {_num(alg.kl_loss_coef)}, estimator {alg.kl_loss_estimator}")
        if spec is None or not spec.pairs:
            lines.append("  KL to the reference: " + ("; ".join(kl) if kl else
                         "none (algorithm.kl_in_reward=false, algorithm.use_kl_loss=false)"))
        shaping = (f"overlong shaping over the last {alg.overlong_buffer_len} response tokens (penalty factor "
                   f"{_num(alg.overlong_penalty_factor)})" if alg.overlong_buffer_len else "overlong shaping off")
        sampling = (f"dynamic sampling on (groups whose rewards are all equal are dropped and refilled, up to "
                    f"{alg.max_gen_batches} generation batches; at the cap: {alg.dynamic_sampling_at_cap})"
                    if alg.dynamic_sampling else "dynamic sampling off")
        lines.append(f"  {sampling}; {shaping}")
    rows = rows_per_step(cfg)
    minis = max(1, -(-rows // actor.mini_batch_size))
    lines.append(f"  actor update: {actor.ppo_epochs} epoch(s) x {minis} mini-batch(es) of {min(actor.mini_batch_size, rows)} "
                 f"samples ({rows} per step) = {actor.ppo_epochs * minis} optimizer step(s) per step (actor.ppo_epochs, "
                 "actor.mini_batch_size)")
    return lines


def describe_run(cfg: RunConfig) -> str:
    dims = model_dims(cfg)
    shapes = hf_param_shapes(dims)
    n_params = sum(prod(s) for s in shapes.values())
    res = cfg.resources
    sizes = role_world_sizes(cfg)
    train, gen, scheme = layouts(cfg)
    sync = synced_dtype(cfg)
    plan = plan_reshard({n: ParamMeta(s, sync) for n, s in shapes.items()}, src=train, dst=gen,
                        num_layers=dims.num_layers)
    recv = [plan.bytes_received(r) for r in gen.ranks]
    model_bytes = n_params * sync.itemsize
    lines = [
        f"algorithm: {cfg.algorithm.name} (advantage estimator {cfg.algorithm.adv_estimator}, "
        f"{cfg.algorithm.n_samples} sample(s) per prompt, critic {'on' if cfg.uses_critic else 'off'}, "
        f"reference {'on' if cfg.uses_ref else 'off'})",
        *algorithm_lines(cfg),
        f"model: {n_params / 1e9:.3f}B parameters, {dims.num_layers} layers, hidden {dims.hidden_size}, "
        f"heads {dims.num_heads}/{dims.num_kv_heads} kv, vocab {dims.vocab_size}",
        (f"placement: {res.placement} on {res.nodes} node(s) x {res.procs_per_node} "
         f"{'GPU' if res.use_gpu else 'CPU'} process(es); group sizes {sizes}") if res.placement == "colocated" else
        (f"placement: split, {process_count(cfg)} {'GPU' if res.use_gpu else 'CPU'} process(es) in all on "
         f"{res.nodes} node(s), one group per role; group sizes {sizes}"),
        f"actor training: {cfg.actor.strategy} {train.describe()}" + (
            f" (Ulysses: dp {cfg.actor.dp} x sp {cfg.actor.sp} ranks shard the weights)" if cfg.actor.sp > 1 else ""),
    ]
    if cfg.uses_critic:
        c = cfg.critic
        lines.append(f"critic training: {c.strategy} pp={c.pp} tp={c.tp} dp={c.dp}" + (f" sp={c.sp}" if c.sp > 1 else ""))
    lines += [
        f"rollout: vLLM-style generation tp={gen.tp} x {gen.dp} replicas ({cfg.rollout.backend} backend)",
        f"resharding ({scheme}), in {str(sync).removeprefix('torch.')} as the rollout computes"
        + (f" (delta syncs, full every {cfg.rollout.delta_full_every})" if cfg.rollout.weight_sync == "delta" else "")
        + f": per rank receives max {max(recv) / GiB:.3f} GiB, mean "
        f"{sum(recv) / len(recv) / GiB:.3f} GiB; gathering full tensors on every rank would receive "
        f"{model_bytes / GiB:.3f} GiB per rank; {len(plan.transfers)} transfers",
    ]
    if res.placement == "split":
        lines.append(fanout_line(cfg, train, gen, {n: ParamMeta(s, sync) for n, s in shapes.items()}, dims.num_layers))
    return "\n".join(lines + memory_lines(cfg, dims, shapes))


def fanout_line(cfg: RunConfig, train: Layout, gen: Layout, metas: dict, num_layers: int) -> str:
    """Split placement's sync to the generation replicas as the job plans it (rollout.weight_fanout), with
    what the other fan-out would send, and the transport per pair (rollout.weight_transport)."""
    replicas, per = gen.dp, gen.tp
    direct = plan_reshard(metas, src=train, dst=gen, num_layers=num_layers)
    first = split_generation_layout(train, tp=per, world=replicas * per, chain=True)
    chained = plan_reshard(metas, src=train, dst=first, num_layers=num_layers)
    sent = {"direct": sum(map(direct.bytes_sent, train.ranks)), "chain": sum(map(chained.bytes_sent, train.ranks))}
    relayed = sum(map(chained.bytes_received, first.ranks)) * (replicas - 1)
    mode = cfg.rollout.weight_fanout
    other = "chain" if mode == "direct" else "direct"
    transport = cfg.rollout.weight_transport
    if transport == "auto":
        transport = ("auto: shared-memory rings between ranks on one host, gloo between hosts" if cfg.resources.nodes > 1
                     else "auto: shared-memory rings (one host)")
    return (f"weight fan-out to {replicas} replica(s) ({mode}): the training ranks send {sent[mode] / GiB:.3f} GiB per "
            f"sync" + (f", the replicas forward {relayed / GiB:.3f} GiB along the chain" if mode == "chain" else "")
            + (f" ({other}: {sent[other] / GiB:.3f} GiB from the training ranks)" if replicas > 1 else "")
            + f"; transport {transport}")
