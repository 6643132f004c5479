"""Resharding between training and generation layouts (HybridFlow's 3D-HybridEngine).

- `layout`: `Layout` (pp, tp, dp, rank order, FSDP) and the Box each rank holds of each HF parameter;
  `hybridflow_generation_layout` for the strided zero-redundancy generation layout, and
  `generation_layout`, which picks the layout the actor (and the dry run) reshards into.
- `planner`: `plan_reshard` intersects source and destination boxes into per-peer transfers.
- `executor`: `execute_plan` moves them in bounded buckets with batched isend/irecv and streams
  `(name, Box, tensor)` pieces into a consumer, measuring its own bytes and memory.
- `formats`: pure HF <-> Megatron-core <-> vLLM conversions of one TP rank's tensors.
"""

from rlframe.resharding.box import Box, chunk_box
from rlframe.resharding.executor import ReshardStats, ShardAssembler, assemble, execute_plan
from rlframe.resharding.formats import (
    ModelDims,
    hf_param_shapes,
    hf_to_megatron,
    hf_to_vllm,
    megatron_to_hf,
    vllm_to_hf,
)
from rlframe.resharding.layout import (
    Layout,
    generation_layout,
    hf_tp_split_dim,
    hybridflow_generation_layout,
    param_stage,
    stage_layer_range,
    training_box,
)
from rlframe.resharding.planner import (
    ParamMeta,
    Plan,
    Transfer,
    cached_plan,
    make_buckets,
    param_metas,
    plan_reshard,
)

__all__ = [
    "Box", "chunk_box", "Layout", "generation_layout", "hf_tp_split_dim", "hybridflow_generation_layout", "param_stage",
    "stage_layer_range", "training_box", "ParamMeta", "Plan", "Transfer", "make_buckets", "param_metas",
    "plan_reshard", "cached_plan", "ReshardStats", "ShardAssembler", "assemble", "execute_plan", "ModelDims", "hf_param_shapes",
    "hf_to_megatron", "hf_to_vllm", "megatron_to_hf", "vllm_to_hf",
]
