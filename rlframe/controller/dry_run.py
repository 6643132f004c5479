"""`trainer.dry_run=true`: print placement, layouts, the resharding plan and a memory estimate.

Runs on a laptop for any cluster config: it needs only the model's shapes (from `model.hf_config`,
the `config.json` at `model.path`, or the tiny preset), never weights, GPUs or Ray.
"""

from __future__ import annotations

import json
from math import prod
from pathlib import Path

from rlframe.config.schema import RunConfig
from rlframe.config.resources import process_count, role_world_sizes
from rlframe.resharding.formats import ModelDims, hf_param_shapes
from rlframe.resharding.layout import Layout, generation_layout
from rlframe.resharding.planner import ParamMeta, plan_reshard
from rlframe.workers.weight_plan import split_generation_layout

GiB = 1 << 30
DEVICE_GIB = 80  # per-GPU memory the estimate is compared with


def model_dims(cfg: RunConfig) -> ModelDims:
    """Shapes of the actor model without loading weights."""
    from types import SimpleNamespace

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
    raw = {"num_key_value_heads": raw.get("num_attention_heads"), "model_type": "llama", **raw}
    return ModelDims.from_hf_config(SimpleNamespace(**raw))


def layouts(cfg: RunConfig) -> tuple[Layout, Layout, str]:
    """Training layout of the actor, generation layout, and which scheme maps one to the other."""
    a = cfg.actor
    train = Layout(tp=a.tp, dp=a.dp, pp=a.pp, fsdp=a.strategy == "fsdp")
    if cfg.resources.placement == "split":  # the generation group's own ranks, after the actor's
        gen = split_generation_layout(train, tp=cfg.rollout.tp, world=role_world_sizes(cfg)["rollout"])
        return train, gen, "split placement: actor group -> generation group over the weight channel"
    return (train, *generation_layout(train, tp=cfg.rollout.tp))


def runtime_dtype(cfg: RunConfig):
    """The compute dtype the actor's engine and vLLM will use (engines.base.resolve_mixed_precision)."""
    from rlframe.workers.engines.base import precision_dtype

    return precision_dtype(cfg.actor.precision, on_gpu=cfg.resources.use_gpu)


def _training_state_bytes(role, n_params: int, wbytes: int) -> float:
    """Per-device bytes of a trained role's weights, gradients and Adam state, as its engine holds them."""
    if role.strategy == "fsdp":  # fp32 sharded parameters (the master copy), gradients and moments
        return n_params * (4 + 4 + 8) / (role.dp * role.tp)
    mp = role.tp * role.pp  # megatron: compute-dtype weights, fp32 grad buffer (grad_reduce_in_fp32),
    main = 4 if wbytes < 4 else 0  # distributed optimizer: fp32 main copy of 16-bit weights + moments
    return n_params * (wbytes + 4) / mp + n_params * (main + 8) / (mp * role.dp)


def memory_estimate(cfg: RunConfig, n_params: int) -> list[tuple[str, float]]:
    """Per-device GiB of each colocated part (weights, grads, optimizer, vLLM; no activations), with
    the dtypes and KV-cache size the runtime uses."""
    from rlframe.workers.common import kv_cache_bytes

    a, on_gpu = cfg.actor, cfg.resources.use_gpu
    wbytes = runtime_dtype(cfg).itemsize
    rows = [("actor training state", _training_state_bytes(a, n_params, wbytes) / GiB)]
    if cfg.uses_ref:  # the reference is built with the actor's layout; fsdp keeps its fp32 shards
        ref = n_params * 4 / (a.dp * a.tp) if a.strategy == "fsdp" else n_params * wbytes / (a.tp * a.pp)
        rows.append(("reference weights", ref / GiB))
    if cfg.uses_critic:
        rows.append(("critic training state", _training_state_bytes(cfg.critic, n_params, wbytes) / GiB))
    weights = n_params * wbytes / cfg.rollout.tp
    rows.append(("rollout weights", weights / GiB))
    kv = kv_cache_bytes(cfg.rollout, on_gpu=on_gpu)
    if kv is not None:
        rows.append(("vLLM KV cache (rollout.kv_cache_bytes; on CPU at most)", kv / GiB))
    else:  # vLLM's budget gpu_memory_utilization * device holds its weights and the KV cache
        rows.append(("vLLM KV cache (gpu_memory_utilization budget - weights)",
                     cfg.rollout.gpu_memory_utilization * DEVICE_GIB - weights / GiB))
    return rows


def describe_run(cfg: RunConfig) -> str:
    dims = model_dims(cfg)
    shapes = hf_param_shapes(dims)
    n_params = sum(prod(s) for s in shapes.values())
    res = cfg.resources
    sizes = role_world_sizes(cfg)
    train, gen, scheme = layouts(cfg)
    dtype = runtime_dtype(cfg)
    itemsize = dtype.itemsize
    plan = plan_reshard({n: ParamMeta(s, dtype) for n, s in shapes.items()}, src=train, dst=gen,
                        num_layers=dims.num_layers)
    recv = [plan.bytes_received(r) for r in gen.ranks]
    model_bytes = n_params * itemsize
    lines = [
        f"algorithm: {cfg.algorithm.name} (advantage estimator {cfg.algorithm.adv_estimator}, "
        f"{cfg.algorithm.n_samples} sample(s) per prompt, critic {'on' if cfg.uses_critic else 'off'}, "
        f"reference {'on' if cfg.uses_ref else 'off'})",
        f"model: {n_params / 1e9:.3f}B parameters, {dims.num_layers} layers, hidden {dims.hidden_size}, "
        f"heads {dims.num_heads}/{dims.num_kv_heads} kv, vocab {dims.vocab_size}",
        (f"placement: {res.placement} on {res.nodes} node(s) x {res.procs_per_node} "
         f"{'GPU' if res.use_gpu else 'CPU'} process(es); group sizes {sizes}") if res.placement == "colocated" else
        (f"placement: split, {process_count(cfg)} {'GPU' if res.use_gpu else 'CPU'} process(es) in all on "
         f"{res.nodes} node(s), one group per role; group sizes {sizes}"),
        f"actor training: {cfg.actor.strategy} {train.describe()}",
    ]
    if cfg.uses_critic:
        c = cfg.critic
        lines.append(f"critic training: {c.strategy} pp={c.pp} tp={c.tp} dp={c.dp}")
    lines += [
        f"rollout: vLLM-style generation tp={gen.tp} x {gen.dp} replicas ({cfg.rollout.backend} backend)",
        f"resharding ({scheme}): per rank receives max {max(recv) / GiB:.3f} GiB, mean "
        f"{sum(recv) / len(recv) / GiB:.3f} GiB; gathering full tensors on every rank would receive "
        f"{model_bytes / GiB:.3f} GiB per rank; {len(plan.transfers)} transfers",
        f"memory estimate per device (GiB, no activations; {DEVICE_GIB} GiB device):",
    ]
    rows = memory_estimate(cfg, n_params)
    lines += [f"  {name:<56} {gib:8.2f}" for name, gib in rows]
    if res.placement == "split":  # each group's devices hold only their own parts
        gen_rows = [g for name, g in rows if name.startswith(("rollout", "vLLM"))]
        total = max(sum(gen_rows), max(g for name, g in rows if not name.startswith(("rollout", "vLLM"))))
        lines.append(f"  {'largest group (split: generation vs one training role)':<56} {total:8.2f}")
    else:
        total = sum(g for _, g in rows)
        lines.append(f"  {'total (colocated)':<56} {total:8.2f}")
    kv = rows[-1][1]
    if kv <= 0:
        lines.append(f"  vLLM gets no KV cache: rollout.gpu_memory_utilization * {DEVICE_GIB} GiB does not hold "
                     f"its {rows[-2][1]:.2f} GiB of weights; raise gpu_memory_utilization or rollout.tp")
    if res.use_gpu:
        verdict = "fits" if total <= DEVICE_GIB and kv > 0 else \
            "does NOT fit (raise tp/pp/nodes, or lower gpu_memory_utilization)"
        lines.append(f"  {verdict} in {DEVICE_GIB} GiB before activations")
    return "\n".join(lines)
