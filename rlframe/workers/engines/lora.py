"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") for the fsdp engine.

A target projection `W` (out, in) of every decoder layer becomes
    y = x W^T + b + scaling * B(A(dropout(x))),   A: (r, in), B: (out, r), scaling = alpha / r
with W and b frozen; only A and B (and a critic's value head) train. Initialisation follows PEFT:
A kaiming-uniform (a = sqrt(5)), B zeros, so an untrained adapter leaves the model unchanged.

Names stay HF names: the projection module keeps `weight`/`bias` and gains the children `lora_A` and
`lora_B`, so `model.layers.0.self_attn.q_proj.weight` is still the base weight and the adapter is
`model.layers.0.self_attn.q_proj.lora_A.weight` / `.lora_B.weight`. PEFT's files prefix these with
`base_model.model.` (`peft_state_dict`, `peft_adapter_config`).

Adapters are injected into the full model BEFORE tensor parallelism and FSDP2, so both shard them.
Under tp, `LoraParallel` replaces the stock column/row styles for an adapted projection and the
forward does the Megatron collectives itself (Shoeybi et al. 2019, the f and g operators):
- column-parallel (q, k, v, gate, up): W, b and B split on the output dim, A replicated.
  x is replicated; h = A x is computed whole on every rank and passes `_CopyToTP` (identity
  forward, all-reduce of its gradient), because each rank's B slice only sees its own outputs.
- row-parallel (o, down): W and A split on the input dim, b and B replicated. x arrives split on
  its last dim; h = A_local x_local is a partial sum that `_ReduceFromTP` all-reduces (gradient
  passed through), then the replicated B applies.
Every replicated adapter thus gets the same gradient on every tp rank, so a step keeps it replicated.

The reference policy of a LoRA actor is its base model: `adapters_disabled(model)` turns every
adapter off for a forward, so no second copy of the model is loaded.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
# The projections the engine's tensor-parallel plan knows; LoRA may target any of them.
SUPPORTED_TARGETS = COLUMN_PARALLEL + ROW_PARALLEL
DEFAULT_TARGETS = SUPPORTED_TARGETS
ADAPTER_LEAVES = ("lora_A", "lora_B")
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        check_lora_settings(rank=self.rank, alpha=self.alpha, target_modules=self.target_modules,
                            dropout=self.dropout, where="LoRA")
        if self.rank < 1:
            raise ValueError(f"LoraSettings needs rank >= 1 (got {self.rank}); rank 0 means no LoRA")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_meta(self) -> dict:
        """What a checkpoint records (and a loading engine must match)."""
        return {"rank": self.rank, "alpha": float(self.alpha), "target_modules": sorted(self.target_modules),
                "dropout": float(self.dropout)}


def check_lora_settings(*, rank: int, alpha: float, target_modules, dropout: float, where: str) -> None:
    """ValueError naming what is wrong with LoRA settings, why, and how to fix it."""
    if rank < 0:
        raise ValueError(f"{where}: lora_rank={rank} must be >= 0 (0: no LoRA, > 0: the adapters' rank, "
                         "e.g. 8)")
    if rank == 0:
        return
    if not alpha > 0:
        raise ValueError(f"{where}: lora_alpha={alpha} must be > 0 (the adapter output is scaled by "
                         "lora_alpha / lora_rank); use e.g. lora_alpha=16")
    if not 0 <= dropout < 1:
        raise ValueError(f"{where}: lora_dropout={dropout} must be in [0, 1); use 0 for none")
    targets = list(target_modules)
    if not targets:
        raise ValueError(f"{where}: lora_target_modules is empty, so no layer would get an adapter; "
                         f"list some of {list(SUPPORTED_TARGETS)}")
    unknown = [t for t in targets if t not in SUPPORTED_TARGETS]
    if unknown:
        raise ValueError(f"{where}: lora_target_modules {unknown} are not projections the fsdp engine can "
                         f"adapt (its tensor-parallel plan knows {list(SUPPORTED_TARGETS)}); use names from "
                         "that list")


def is_adapter_name(name: str) -> bool:
    """True for `....lora_A.weight` / `....lora_B.weight` parameter names."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_LEAVES


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over tp (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over tp forward; identity gradient (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AdapterWeight(nn.Module):
    """Holds one adapter matrix as `.weight`, so its name is `<projection>.lora_A.weight`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)


class LoraLinear(nn.Module):
    """A frozen nn.Linear (same `weight`/`bias` names) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float, generator: torch.Generator):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        dev, dtype = base.weight.device, base.weight.dtype
        a = torch.empty(rank, self.in_features, dtype=dtype)  # drawn on CPU, also for a meta-device base
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # as PEFT's default init
        b = torch.zeros(self.out_features, rank, dtype=dtype)
        # What the adapters start from, kept while the base is on the meta device (fsdp/sharded_load.py)
        self.initial = {"lora_A.weight": a, "lora_B.weight": b} if dev.type == "meta" else None
        self.lora_A = _AdapterWeight(a.to(dev))
        self.lora_B = _AdapterWeight(b.to(dev))
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True
        self.tp_style: str | None = None  # "colwise" | "rowwise" once LoraParallel applied
        self.tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = _local(self.weight), None if self.bias is None else _local(self.bias)
        if self.tp_style == "colwise":
            y = F.linear(_CopyToTP.apply(x, self.tp_group), w, b)  # (..., out / tp)
        elif self.tp_style == "rowwise":
            y = _ReduceFromTP.apply(F.linear(x, w), self.tp_group)  # x: (..., in / tp)
            y = y if b is None else y + b
        else:
            y = F.linear(x, w, b)
        if not self.adapter_enabled:
            return y
        h = F.linear(self.dropout(x), _local(self.lora_A.weight))  # (..., r)
        if self.tp_style == "colwise":
            h = _CopyToTP.apply(h, self.tp_group)
        elif self.tp_style == "rowwise":
            h = _ReduceFromTP.apply(h, self.tp_group)
        return y + F.linear(h, _local(self.lora_B.weight)) * self.scaling

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"r={self.lora_A.weight.shape[0]}, scaling={self.scaling}, tp_style={self.tp_style}")


def lora_parallel_style(style: str):
    """A tensor-parallel style (for `parallelize_module`) of a LoraLinear: "colwise" or "rowwise"."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    # (weight, bias, lora_A, lora_B) placements on the tp mesh
    placements = {"colwise": (Shard(0), Shard(0), Replicate(), Shard(0)),
                  "rowwise": (Shard(1), Replicate(), Shard(1), Replicate())}[style]

    class LoraParallel(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            assert isinstance(module, LoraLinear), type(module)
            for owner, attr, pl in ((module, "weight", placements[0]), (module, "bias", placements[1]),
                                    (module.lora_A, "weight", placements[2]),
                                    (module.lora_B, "weight", placements[3])):
                p = getattr(owner, attr)
                if p is None:
                    continue
                owner.register_parameter(attr, nn.Parameter(distribute_tensor(p.data, device_mesh, [pl]),
                                                            requires_grad=p.requires_grad))
            module.tp_style, module.tp_group = style, device_mesh.get_group()
            return module

    return LoraParallel()


def inject_lora(model: nn.Module, settings: LoraSettings, *, seed: int, trainable_prefixes=()) -> list[str]:
    """Replace each target nn.Linear of `model` (matched by its leaf name) by a LoraLinear, freeze every
    parameter that is not an adapter or under `trainable_prefixes` (a critic's `score.`); return the
    adapted module names. Initialisation draws from `seed` in module order, identically on every rank."""
    targets = set(settings.target_modules)
    g = torch.Generator().manual_seed(seed)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    adapted = []
    for name, module in linears:
        parent_name, _, leaf = name.rpartition(".")
        if leaf not in targets:
            continue
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoraLinear(module, rank=settings.rank, alpha=settings.alpha,
                                         dropout=settings.dropout, generator=g))
        adapted.append(name)
    missing = sorted(targets - {n.rpartition(".")[2] for n in adapted})
    if missing:
        leaves = sorted({n.rpartition(".")[2] for n, _ in linears})
        raise ValueError(f"lora_target_modules {missing} match no nn.Linear of {type(model).__name__} (its linear "
                         f"layers are {leaves}); remove them from lora_target_modules")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name) or name.startswith(tuple(trainable_prefixes)))
    return adapted


def lora_modules(model: nn.Module) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


@contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block the model computes as its base model (every adapter off)."""
    mods = lora_modules(model)
    for m in mods:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.adapter_enabled = True


# ---- export: merged weights and PEFT's format ---------------------------------------------------
def merge_state_dict(full: dict[str, torch.Tensor], settings: LoraSettings) -> dict[str, torch.Tensor]:
    """Full HF state with every adapter folded into its base weight (W + scaling * B @ A), adapters
    dropped: the plain model a LoRA run trained."""
    out = {k: v for k, v in full.items() if not is_adapter_name(k)}
    for name in full:
        if name.endswith(".lora_A.weight"):
            module = name[: -len(".lora_A.weight")]
            a, b = full[name].double(), full[f"{module}.lora_B.weight"].double()
            w = out[f"{module}.weight"]
            out[f"{module}.weight"] = (w.double() + settings.scaling * (b @ a)).to(w.dtype)
    return out


def peft_state_dict(full: dict[str, torch.Tensor], *, head: str) -> dict[str, torch.Tensor]:
    """PEFT's adapter file: `base_model.model.<module>.lora_{A,B}.weight` (+ a critic's value head,
    saved whole as a module PEFT keeps)."""
    from rlframe.workers.engines.value_head import VALUE_HEAD

    keep = [k for k in full if is_adapter_name(k) or (head == "value" and k in VALUE_HEAD)]
    return {PEFT_PREFIX + k: full[k].contiguous() for k in keep}


def peft_adapter_config(settings: LoraSettings, *, base_model_path: str, head: str) -> dict:
    """The fields of PEFT's adapter_config.json (a LoraConfig) for these adapters."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if head == "lm" else "TOKEN_CLS",
        "base_model_name_or_path": base_model_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(settings.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": ["score"] if head == "value" else None,
    }


def write_peft_adapter(out_dir: str, full: dict[str, torch.Tensor], settings: LoraSettings, *,
                       base_model_path: str, head: str) -> None:
    """`adapter_model.safetensors` + `adapter_config.json`: a directory `PeftModel.from_pretrained` loads."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(peft_state_dict(full, head=head), os.path.join(out_dir, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(peft_adapter_config(settings, base_model_path=base_model_path, head=head), f, indent=1)
