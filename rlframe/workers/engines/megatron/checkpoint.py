"""Checkpoints, full state and HF export of the megatron engine.

A checkpoint directory (written atomically by `engines.checkpoint.save_atomically`) holds, per
(tp rank, pp stage), `mp_{tp}_{pp}/`: `model.pt` (the stage's tp shard, megatron names),
`optimizer.pt` (the distributed optimizer's non-parameter state) and `param_state.pt` (its fp32
main parameters and Adam moments, gathered over dp by megatron-core's `save_parameter_state`);
dp rank 0 of each model-parallel group writes them. Reloading needs the same tp and pp; the dp size
may change (megatron-core re-shards the parameter state over the new dp group).

Full state and export go through the resharding planner: the training layout is resharded into a
layout that holds whole tensors (every rank for `full_state_dict`, rank 0 alone for `export_hf`),
so no rank ever holds more than what it asked for.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist

from rlframe.workers.engines.megatron.spec import MEGATRON
from rlframe.resharding.executor import ShardAssembler, execute_plan
from rlframe.resharding.layout import Layout
from rlframe.resharding.planner import plan_reshard
from rlframe.workers.engines import checkpoint as ckpt
from rlframe.workers.engines.megatron.weights import hf_param_metas


def _rank_dir(engine, root: str) -> str:
    pp, tp, _ = engine.layout_.coords_of(engine.rank)
    return os.path.join(root, f"mp_{tp:02d}_{pp:03d}")


def _is_dp_zero(engine) -> bool:
    return engine.layout_.coords_of(engine.rank)[2] == 0


def save_checkpoint(engine, path: str) -> None:
    def write_state(tmp):
        sub = _rank_dir(engine, tmp)
        if _is_dp_zero(engine):
            os.makedirs(sub, exist_ok=True)
            torch.save(engine.module.state_dict(), os.path.join(sub, "model.pt"))
            torch.save(engine.optimizer.state_dict(), os.path.join(sub, "optimizer.pt"))
        dist.barrier()
        engine.optimizer.save_parameter_state(os.path.join(sub, "param_state.pt"))  # collective over dp

    ckpt.save_atomically(engine, path, barrier=dist.barrier, write_state=write_state)


def load_checkpoint(engine, path: str) -> None:
    path = ckpt.check_checkpoint(engine, path)
    with open(os.path.join(path, "layout.json")) as f:
        saved = json.load(f)
    if saved.get("backend") != MEGATRON.name or (saved["tp"], saved["pp"]) != (engine.config.tp, engine.config.pp):
        raise ValueError(f"checkpoint {path!r} was written by backend={saved.get('backend', 'fsdp')} tp={saved['tp']} "
                         f"pp={saved.get('pp', 1)}; this megatron engine is tp={engine.config.tp} pp={engine.config.pp}. "
                         "Resume with the same backend, tp and pp, or start from an exported HF checkpoint")
    sub = _rank_dir(engine, path)
    engine.module.load_state_dict(ckpt.load_tensors(os.path.join(sub, "model.pt"), map_location=engine.device))
    engine.optimizer.load_state_dict(ckpt.load_tensors(os.path.join(sub, "optimizer.pt"), map_location=engine.device))
    with torch.no_grad(), _adam_steps_set_aside(engine.optimizer):
        # no_grad: megatron-core copies into views of the (fp32) parameters themselves
        engine.optimizer.load_parameter_state(os.path.join(sub, "param_state.pt"))
    ckpt.load_engine_state(engine, path)


@contextlib.contextmanager
def _adam_steps_set_aside(optimizer):
    """Hide torch Adam's per-parameter `step` from megatron-core's parameter-state loader.

    Without Apex or Transformer Engine, megatron-core 0.16.1 runs torch's Adam, which keeps a `step`
    tensor in every parameter's state. Two defects follow, both mended here:
    - the parameter-state file holds only param/exp_avg/exp_avg_sq (the step comes back from
      optimizer.pt's param groups), yet the dp-zero loader copies every key of the live state and
      fails on `step`: it is set aside for the load and put back after;
    - `load_state_dict` gives every parameter the *same* step tensor, which torch's Adam then
      increments once per parameter in place, so bias correction after a resume would use a step
      count of about (number of parameters): each parameter gets its own copy back.
    """
    held = [(state, state.pop("step")) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for state in opt.optimizer.state.values() if "step" in state]
    try:
        yield
    finally:
        for state, step in held:
            state["step"] = step.clone() if torch.is_tensor(step) else step


def gather_hf(shards, *, src: Layout, dst: Layout, dims, head: str, rank: int, device) -> dict[str, torch.Tensor]:
    """Whole HF-named tensors (on CPU) on the ranks of `dst` (a tp=pp=1 layout), moved by the
    resharding planner from this rank's `shards` ({name: (shape, box, tensor)}) in layout `src`."""
    metas = hf_param_metas(dims, head=head, dtype=next(iter(shards.values()))[2].dtype)
    plan = plan_reshard(metas, src=src, dst=dst, num_layers=dims.num_layers)
    full: dict[str, torch.Tensor] = {}

    def keep(done):
        for name, _, t in done:
            full[name] = t.detach().to("cpu", copy=True)

    boxes = {n: b for (n, r), b in plan.dst_boxes.items() if r == rank}
    execute_plan(plan, local={n: t for n, (_, _, t) in shards.items()}, consumer=ShardAssembler(boxes, keep),
                 device=device)
    return full


def _gather(engine, dst: Layout) -> dict[str, torch.Tensor]:
    return gather_hf(engine.local_shards(), src=engine.layout_, dst=dst, dims=engine.dims, head=engine.config.head,
                     rank=engine.rank, device=engine.device)


def gather_full_state(engine) -> dict[str, torch.Tensor]:
    return _gather(engine, Layout(dp=dist.get_world_size()))


def export_hf(engine, path: str) -> None:
    full = _gather(engine, Layout(ranks=(0,)))
    ckpt.export_hf(engine, path, full=full, hf_config=engine.hf_config, barrier=dist.barrier)
