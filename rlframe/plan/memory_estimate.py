"""The dry run's memory estimate: GiB on one device, per pipeline stage, from the model's shapes.

A colocated device (hybrid engine) holds the training states of every role at all times and, in
turn, one role's activations while it trains (vLLM asleep: its weights offloaded, its KV cache
freed) or vLLM's whole budget while it generates. Each phase is summed per pipeline stage (the
first stage holds the embedding and pp micro-batches in flight, the last the LM head); the largest
stage in the larger phase decides. With split placement each group's devices hold only their role.

What each row counts (per device):
- training state: the parameters this rank holds (its tp slice of its stage's layers, the
  embedding on the first stage, the final norm and LM head on the last; fsdp: its dim-0 shard)
  times the bytes each engine keeps per parameter (fsdp: fp32 weights, gradients and two Adam
  moments; megatron: compute-dtype weights, an fp32 gradient buffer, and the distributed
  optimizer's fp32 main weights and moments divided over dp); the reference keeps weights only;
- activations: `activation_memory` (formulas checked against autograd's saved tensors);
- fsdp's gathered parameters: FSDP2 keeps the root's (embedding, final norm, LM head) unsharded
  for the whole step and two decoder layers at a time (the running one, the prefetched one), in
  the compute dtype, plus the unreduced gradients of the LM head and of one layer (compute dtype
  and the fp32 copy reduce-scatter sends);
- vLLM: with `gpu_memory_utilization` it takes exactly that fraction of the device
  (vllm/v1/worker/utils.py request_memory) and gives its KV cache what its weights and the
  activation peak it profiles at start-up leave (gpu_worker.determine_available_memory); the peak
  estimated here is one layer's largest live tensors for the profiled token budget plus the
  sampler's fp32 logits, probabilities and their cast for max_num_seqs rows;
- the CUDA context and NCCL buffers: CUDA_CONTEXT_AND_NCCL_GIB, once per process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from math import prod

from rlframe.plugins import backend_spec, engine_spec
from rlframe.config.resources import has_reference_group
from rlframe.config.schema import RunConfig, TrainRoleConfig
from rlframe.plan.activation_memory import micro_batch_bytes
from rlframe.resharding.formats import ModelDims
from rlframe.resharding.layout import Layout, layer_index, stage_layer_range

GiB = 1 << 30

# A PyTorch process's CUDA context on Hopper with lazy module loading (CUDA 12) is about 0.5 GiB
# (cuBLAS/cuDNN workspaces included, as nvidia-smi shows for a process that only initialised CUDA).
# NCCL allocates per communicator NCCL_BUFFSIZE (4 MiB, NCCL's environment docs) per channel and
# peer for each protocol, with up to 32 channels on NVLink, and NVLink SHARP buffers on NVSwitch
# systems; a rank here is in several communicators (tp, dp, pp, the weight sync, vLLM's tp group).
# 2 GiB for both is an estimate, checked against a measured context + communicator by a gpu test.
CUDA_CONTEXT_AND_NCCL_GIB = 2.0
# torch.cuda.mem_get_info()[1] on an H100 80GB (SXM, HBM3): 79.19 GiB, the "total capacity"
# PyTorch's out-of-memory messages print; the default device when no GPU is visible here.
H100_80GB_GIB = 79.19


def vllm_batched_tokens_default(device_gib: float) -> int:
    """vLLM 0.32's token budget of a profiled step (engine/arg_utils.py, the LLM class): 16384 on GPUs
    with at least 70 GiB (H100, H200; vLLM gives an A100 80GB 8192), else 8192."""
    return 16384 if device_gib >= 70 else 8192


def device_memory(setting: float | None) -> tuple[float, str]:
    """(GiB of one device, where the number comes from): the setting, else this machine's GPU, else an H100's."""
    if setting is not None:
        return float(setting), "resources.device_memory_gib"
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1] / GiB, f"this machine's {torch.cuda.get_device_name()}"
    return H100_80GB_GIB, "an H100 80GB, the default; set resources.device_memory_gib for another GPU"


def held_params(shapes: dict[str, tuple[int, ...]], layout: Layout, rank: int, num_layers: int) -> int:
    """Parameters (elements) `rank` holds in `layout`."""
    boxes = (layout.box(n, s, rank, num_layers=num_layers) for n, s in shapes.items())
    return sum(b.numel for b in boxes if b is not None)


def role_shapes(shapes: dict[str, tuple[int, ...]], head: str) -> dict[str, tuple[int, ...]]:
    """The LM's shapes with the critic's value head (Linear(hidden, 1)) in the LM head's place."""
    if head == "lm":
        return shapes
    out = {n: s for n, s in shapes.items() if n != "lm_head.weight"}
    return {**out, "score.weight": (1, shapes["model.norm.weight"][0]), "score.bias": (1,)}


def lora_fraction(shapes: dict[str, tuple[int, ...]], role: TrainRoleConfig) -> float:
    """LoRA adapters' parameters (rank r on each targeted (out, in) weight: r (in + out)) over the model's."""
    targets = tuple(f".{m}.weight" for m in role.lora_target_modules)
    adapters = sum(role.lora_rank * (s[0] + s[1]) for n, s in shapes.items() if n.endswith(targets) and len(s) == 2)
    return adapters / sum(prod(s) for s in shapes.values())


Row = tuple[str, float]  # (part, GiB)


@dataclass
class Device:
    """One device's parts: held throughout, held while one role trains (the largest role counts),
    held while vLLM generates."""

    label: str
    always: list[Row] = field(default_factory=list)
    training: dict[str, list[Row]] = field(default_factory=dict)
    generation: list[Row] = field(default_factory=list)

    def rows(self) -> list[Row]:
        return self.always + [r for rows in self.training.values() for r in rows] + self.generation

    @property
    def training_gib(self) -> float:
        steps = [sum(g for _, g in rows) for rows in self.training.values()]
        return sum(g for _, g in self.always) + max(steps, default=0.0)

    @property
    def generation_gib(self) -> float:
        return sum(g for _, g in self.always) + sum(g for _, g in self.generation)

    @property
    def peak_gib(self) -> float:
        return max(self.training_gib, self.generation_gib)


def train_layout(c: TrainRoleConfig) -> Layout:
    """A role's training layout as the resharding planner sees it (Ulysses' sp ranks hold the weights
    as dp ranks do: FSDP shards them over dp x sp)."""
    return Layout(tp=c.tp, dp=c.dp * c.sp, pp=c.pp, fsdp=engine_spec(c.strategy).weights_sharded_over_dp)


@dataclass(frozen=True)
class Role:
    name: str
    cfg: TrainRoleConfig
    head: str
    trained: bool

    def layout(self) -> Layout:
        return train_layout(self.cfg)


def training_roles(cfg: RunConfig) -> list[Role]:
    """The roles whose engines hold the model on training devices: actor, reference, critic."""
    roles = [Role("actor", cfg.actor, "lm", True)]
    if has_reference_group(cfg):  # built with the actor's layout
        roles.append(Role("reference", cfg.actor, "lm", False))
    if cfg.uses_critic:
        roles.append(Role("critic", cfg.critic, "value", True))
    return roles


class Estimate:
    """Rows per device for `cfg`; `wbytes` is the compute dtype's size (engines and vLLM)."""

    def __init__(self, cfg: RunConfig, dims: ModelDims, shapes: dict[str, tuple[int, ...]], wbytes: int):
        self.cfg, self.dims, self.shapes, self.b = cfg, dims, shapes, wbytes
        self.gpu = cfg.resources.use_gpu
        self.device_gib, self.device_source = device_memory(cfg.resources.device_memory_gib)
        self.context = [("CUDA context + NCCL buffers (estimate)",
                         CUDA_CONTEXT_AND_NCCL_GIB)] if self.gpu else []

    # ---- training roles ------------------------------------------------------------------------
    def _params(self, role: Role, stage: int) -> int:
        lay = role.layout()
        return held_params(role_shapes(self.shapes, role.head), lay, lay.rank_of(pp=stage),
                           self.dims.num_layers)

    def state_gib(self, role: Role, stage: int) -> tuple[str, float]:
        """Weights, gradients and optimizer state as the role's engine holds them (its spec's memory
        model); `n` is what this device holds of the parameters (a shard where they are sharded over dp)."""
        c, n, b = role.cfg, self._params(role, stage), self.b
        spec = engine_spec(c.strategy)
        shard = f" ({c.strategy} shard)" if spec.weights_sharded_over_dp else ""
        if not role.trained:
            per = 4 if spec.fp32_params else b  # fp32 parameters stay fp32 in a frozen copy too
            return f"{role.name} weights", n * per / GiB
        if spec.fp32_params and c.lora_rank > 0:  # a frozen fp32 base; grads and Adam for the adapters
            adapters = n * lora_fraction(role_shapes(self.shapes, role.head), c)
            return f"{role.name} fp32 base, LoRA adapters with grads and Adam{shard}", (n * 4 + adapters * 16) / GiB
        if spec.fp32_params:  # fp32 weights and grads, Adam's two moments
            return f"{role.name} fp32 weights, grads, Adam{shard}", n * 16 / GiB
        main = 4 if b < 4 else 0  # fp32 main weights of compute-dtype parameters
        optimizer = (main + 8) / (c.dp if spec.distributed_optimizer else 1)
        what = "dp-sharded optimizer" if spec.distributed_optimizer else "optimizer"
        return f"{role.name} weights, fp32 grads, {what}", n * (b + 4 + optimizer) / GiB

    def _tokens(self, c: TrainRoleConfig) -> tuple[int, int, int]:
        """(tokens per micro-batch, its longest sequence, micro-batches per rank and mini-batch)."""
        seq = self.cfg.data.prompt_length + self.cfg.data.response_length  # a trained row (vLLM's may be longer)
        per_rank = max(1, c.rows_per_rank)
        if c.max_tokens_per_micro_batch is not None:  # a rank's budget: sp ranks share a micro-batch
            budget = c.max_tokens_per_micro_batch * c.sp
            return budget, min(seq, budget), per_rank
        mbs = min(c.micro_batch_size or per_rank, per_rank)
        return mbs * seq, seq, math.ceil(per_rank / mbs)

    def activations_gib(self, role: Role, stage: int) -> tuple[str, float]:
        c = role.cfg
        tokens, seq, n_micro = self._tokens(c)
        in_flight = min(c.pp - stage, n_micro)  # a pipeline schedule's micro-batches in flight (1 without pp)
        layers = len(stage_layer_range(self.dims.num_layers, pp=c.pp, stage=stage))
        gib = micro_batch_bytes(
            self.dims, modules=engine_spec(c.strategy).activations, itemsize=self.b, tp=c.tp, sequence_parallel=c.sequence_parallel,
            tokens=tokens, seq_len=seq, layers=layers, last_stage=stage == c.pp - 1, head=role.head,
            checkpointing=c.activation_checkpointing, in_flight=in_flight, ulysses=c.sp) / GiB
        what = "checkpointed" if c.activation_checkpointing else "no recompute"
        flight = f", {engine_spec(c.strategy).pipeline_schedule}" if c.pp > 1 else ""
        split = f", 1/{c.sp} of them per Ulysses rank" if c.sp > 1 else ""
        return f"{role.name} activations ({tokens} tokens/micro-batch{split}, {what}{flight})", gib

    def gathered_gib(self, role: Role) -> tuple[str, float]:
        """The unsharded parameters and unreduced gradients a step holds (an engine that gathers
        layers: FSDP2's root, the layer being computed and the next one prefetched)."""
        tp, b = role.cfg.tp, self.b
        shapes = role_shapes(self.shapes, role.head)
        root = sum(prod(s) for n, s in shapes.items() if layer_index(n) is None)
        layer = sum(prod(s) for n, s in shapes.items() if layer_index(n) == 0)
        head = prod(shapes["lm_head.weight"]) if "lm_head.weight" in shapes else 0  # tied: in root
        grads = layer * lora_fraction(shapes, role.cfg) if role.cfg.lora_rank > 0 else layer  # only adapters train
        n = (root + 2 * layer) * b + head * b + grads * (b + 4)
        return f"{role.name} gathered params, unreduced grads ({role.cfg.strategy})", n / tp / GiB

    # ---- vLLM ----------------------------------------------------------------------------------
    def vllm_rows(self) -> list[tuple[str, float]]:
        """The rollout engine's rows: a paged-KV-cache backend's (vLLM's) weights, activation peak and
        KV cache; another backend's weights (what its generate allocates is not estimated)."""
        from rlframe.workers.common import kv_cache_bytes

        ro, dims, b = self.cfg.rollout, self.dims, self.b
        weights = held_params(self.shapes, Layout(tp=ro.tp), 0, dims.num_layers) * b / GiB
        spec = backend_spec(ro.backend)
        if not spec.paged_kv_cache:
            return [(f"rollout weights ({spec.name}; its generate's cache is not estimated)", weights)]
        if not self.gpu:
            return [("rollout weights", weights),
                    ("vLLM KV cache (rollout.kv_cache_bytes; on CPU at most)", kv_cache_bytes(ro, on_gpu=False) / GiB)]
        tokens = ro.engine_kwargs.get("max_num_batched_tokens") or vllm_batched_tokens_default(self.device_gib)
        live = tokens * b * (2 * dims.hidden_size + 3 * dims.intermediate_size / ro.tp)
        sampler = ro.max_num_seqs * dims.vocab_size * (8 + b)
        peak = (live + sampler) / GiB
        rows = [(f"vLLM weights (tp {ro.tp})", weights),
                (f"vLLM activation peak (estimate, {tokens} tokens)", peak)]
        if ro.kv_cache_bytes is not None:
            return rows + [("vLLM KV cache (rollout.kv_cache_bytes)", ro.kv_cache_bytes / GiB)]
        budget = ro.gpu_memory_utilization * self.device_gib
        return rows + [(f"vLLM KV cache ({ro.gpu_memory_utilization} x device - weights - peak)",
                        budget - weights - peak)]

    # ---- devices -------------------------------------------------------------------------------
    def _add_role(self, dev: Device, role: Role, stage: int) -> None:
        dev.always.append(self.state_gib(role, stage))
        if role.trained:
            dev.training[role.name] = [self.activations_gib(role, stage)] + (
                [self.gathered_gib(role)] if engine_spec(role.cfg.strategy).gathers_layers else [])

    def verdict(self, devices: list[Device]) -> tuple[bool, Device, bool]:
        """(whether the devices hold the run, the fullest device, whether vLLM is left without a KV
        cache): the peak within the device and a KV cache for vLLM."""
        worst = max(devices, key=lambda d: d.peak_gib)
        kv = [g for d in devices for name, g in d.generation if name.startswith("vLLM KV cache")]
        no_kv = bool(kv) and min(kv) <= 0
        return worst.peak_gib <= self.device_gib and not no_kv, worst, no_kv

    def devices(self) -> list[Device]:
        """A Device per distinct set of pipeline stages a colocated rank holds, or with split
        placement per group (and stage)."""
        roles = training_roles(self.cfg)
        if self.cfg.resources.placement == "split":
            out = [Device("generation", always=list(self.context), generation=self.vllm_rows())]
            for role in roles:
                for stage in range(role.cfg.pp):
                    dev = Device(f"{role.name}" + (f" stage {stage}" if role.cfg.pp > 1 else ""),
                                 always=list(self.context))
                    self._add_role(dev, role, stage)
                    out.append(dev)
            return out
        world = self.cfg.resources.nodes * self.cfg.resources.procs_per_node
        layouts = [r.layout() for r in roles]
        keys = sorted({tuple(lay.coords_of(rank)[0] for lay in layouts) for rank in range(world)})
        out, vllm = [], self.vllm_rows()  # the same on every device
        for key in keys:
            label = "stage " + "/".join(map(str, sorted(set(key)))) if len(keys) > 1 else "each device"
            dev = Device(label, always=list(self.context), generation=list(vllm))
            for role, stage in zip(roles, key):
                self._add_role(dev, role, stage)
            out.append(dev)
        return out


def checkpoint_bytes(cfg: RunConfig, shapes: dict[str, tuple[int, ...]], wbytes: int,
                     critic_shapes: dict[str, tuple[int, ...]] | None = None) -> int:
    """About the bytes a run checkpoint takes on disk (each parameter once, whatever the layout): per
    trained role (actor, critic) its weights as its engine keeps them (fp32 where its spec says so,
    else the compute dtype `wbytes`), AdamW's two fp32 moments, and fp32 main weights of compute-dtype
    parameters; a LoRA role's checkpoint holds only its adapters (fp32, with their moments). The
    reference is not saved. The checkpoint manager checks the first checkpoint's free space with it.
    `critic_shapes`: the critic's own model (model.critic_path), when it is another than the actor's."""
    total = 0
    for role in (r for r in training_roles(cfg) if r.trained):
        c, spec = role.cfg, engine_spec(role.cfg.strategy)
        role_sh = role_shapes(critic_shapes if role.head == "value" and critic_shapes is not None else shapes, role.head)
        n = sum(prod(s) for s in role_sh.values())
        if c.lora_rank > 0:
            total += int(n * lora_fraction(role_sh, c)) * 12
            continue
        weights = 4 if spec.fp32_params else wbytes
        main = 4 if weights < 4 else 0
        total += n * (weights + main + 8)
    return total


def estimated_checkpoint_bytes(cfg: RunConfig) -> int:
    """`checkpoint_bytes` for the run's model (its config.json, model.hf_config or the tiny preset)."""
    from rlframe.plan.dry_run import model_dims, runtime_dtype
    from rlframe.resharding.formats import hf_param_shapes

    critic = None
    if cfg.model.critic_path is not None:  # another model than the actor's: its own config.json
        import json
        from pathlib import Path

        from rlframe.resharding.formats import ModelDims

        raw = json.loads((Path(cfg.model.critic_path).expanduser() / "config.json").read_text())
        critic = hf_param_shapes(ModelDims.from_hf_config(ModelDims.config_namespace(raw)))
    return checkpoint_bytes(cfg, hf_param_shapes(model_dims(cfg)), runtime_dtype(cfg).itemsize, critic_shapes=critic)
