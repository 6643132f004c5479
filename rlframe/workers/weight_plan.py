"""The resharding plan from a training layout into vLLM's tp slices, for the hybrid engine (both
layouts in one group) and for split placement (the generation group's ranks follow the training
group's on a `P2PChannel`). Both sides of a split sync build the same plan from the same inputs."""

from __future__ import annotations

from transformers import AutoConfig

from rlframe.resharding.formats import ModelDims
from rlframe.resharding.layout import Layout
from rlframe.resharding.planner import Plan, plan_reshard
from rlframe.workers.engines.lora import is_adapter_name
from rlframe.workers.rollout.lora import lora_tp_box
from rlframe.workers.rollout.weight_sync import vllm_tp_box


def vllm_plan(metas: dict, *, src: Layout, dst: Layout, model_path: str) -> Plan:
    """Training shards (`metas`: HF name -> ParamMeta) into vLLM's boxes (padded vocabulary,
    replicated kv heads) for every rank of `dst`; LoRA factors (`...q_proj.lora_A.weight`) into the
    slices vLLM's LoRA layers keep."""
    hf = AutoConfig.from_pretrained(model_path)
    dims = ModelDims.from_hf_config(hf)

    def vllm_box(name, shape, rank):
        box = lora_tp_box if is_adapter_name(name) else vllm_tp_box
        return box(name, shape, tp_rank=dst.coords_of(rank)[1], tp_size=dst.tp,
                   num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim)

    return plan_reshard(metas, src=src, dst=dst, num_layers=dims.num_layers, dst_box=vllm_box)


def split_generation_layout(train: Layout, *, tp: int, world: int, chain: bool = False) -> Layout:
    """The generation group's layout on the channel: its `world` ranks come after the training
    group's (channel ranks train.size .. train.size + world - 1), vLLM's consecutive tp groups.
    With `chain` (rollout.weight_fanout=chain) the plan's layout is the first replica alone: the
    others get the same slices along the chain (`relay_of`)."""
    replicas = world // tp if not chain else 1
    return Layout(tp=tp, dp=replicas, ranks=tuple(range(train.size, train.size + replicas * tp)))


def relay_of(train: Layout, *, tp: int, world: int, channel_rank: int):
    """The chain position (executor.Relay) of generation channel rank `channel_rank`: replica r at tp
    position j mirrors the first replica's rank j, receives from replica r - 1, forwards to r + 1."""
    from rlframe.resharding.executor import Relay

    r, j = divmod(channel_rank - train.size, tp)
    rank = lambda replica: train.size + replica * tp + j  # noqa: E731
    return Relay(mirror=rank(0), upstream=None if r == 0 else rank(r - 1),
                 downstream=rank(r + 1) if (r + 1) * tp < world else None)
