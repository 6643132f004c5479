"""Training engines' specs: what an engine supports and how it holds memory, asked before it runs.

Validation, the planner, the memory estimate, the dry run, the preflight sweep and `rlframe export`
read an engine's `EngineSpec`; the workers build it from `target`. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rlframe.plugins.registry import SpecRegistry

# dp: data parallel; tp: tensor parallel; pp: pipeline parallel; sp: Ulysses sequence parallel
# (a role's `sp`); ep: expert parallel
PARALLELISMS = ("dp", "tp", "pp", "sp", "ep")


@dataclass(frozen=True)
class EngineSpec:
    """A training engine's traits.

    name: the value of `<role>.strategy` that selects it.
    target: "package.module:Class" of its `rlframe.workers.engines.TrainEngine` subclass.
    summary: one line saying what it is (messages, the dry run, docs).
    parallelisms: which of PARALLELISMS a role's layout may set above 1 with it.
    sequence_parallel: megatron-style sequence parallelism inside tp (`<role>.sequence_parallel`), on
        by default when tp > 1 in the plans `rlframe plan` searches.
    lora_targets: the projections it can give LoRA adapters; () when it has no LoRA.
    model_types: the HF `model_type`s it builds; None: whatever transformers loads as a causal LM.
    tied_embeddings: whether it builds models whose input and output embeddings are tied.
    process_global_state: it keeps one model-parallel state per process, so colocated roles on it
        must share (tp, pp).
    Memory model (plan/memory_estimate.py):
    weights_sharded_over_dp: parameters, gradients and optimizer state sharded over dp (FSDP, ZeRO-3);
        else replicated over dp and split by tp/pp only.
    fp32_params: parameters kept in fp32 under mixed precision (a frozen reference's too).
    distributed_optimizer: the optimizer state (and fp32 main weights) sharded over dp.
    gathers_layers: a training step holds each layer's unsharded parameters and gradients in turn.
    activations: which activation formulas of plan/activation_memory.py its modules follow:
        "transformers" (its decoder layers, sdpa or flash attention) or "mcore" (megatron-core's local
        layer spec: unfused softmax and an (s, s) mask kept).
    pipeline_schedule: its pipeline schedule's name when it has pp (the dry run notes it).
    check_model(hf_config, role, *, where): raises ValueError for a model (config.json read into a
        namespace) or layout it would refuse; validation calls it before any worker starts.
    read_checkpoint(engine_dir, layout, hf_config): its checkpoint's model as whole HF-named tensors,
        read without a process group (`rlframe export`).
    """

    name: str
    target: str
    summary: str = ""
    parallelisms: frozenset[str] = field(default_factory=lambda: frozenset({"dp"}))
    sequence_parallel: bool = False
    lora_targets: tuple[str, ...] = ()
    model_types: tuple[str, ...] | None = None
    tied_embeddings: bool = True
    process_global_state: bool = False
    weights_sharded_over_dp: bool = False
    fp32_params: bool = False
    distributed_optimizer: bool = False
    gathers_layers: bool = False
    activations: str = "transformers"
    pipeline_schedule: str = ""
    check_model: Callable | None = None
    read_checkpoint: Callable | None = None

    def __post_init__(self):
        object.__setattr__(self, "parallelisms", frozenset(self.parallelisms))
        unknown = sorted(set(self.parallelisms) - set(PARALLELISMS))
        if unknown or "dp" not in self.parallelisms:
            raise ValueError(f"engine {self.name!r}: parallelisms {sorted(self.parallelisms)} must include dp and "
                             f"be among {PARALLELISMS}")
        if self.activations not in ("transformers", "mcore"):
            raise ValueError(f"engine {self.name!r}: activations={self.activations!r}: use 'transformers' or 'mcore'")

    def supports(self, parallelism: str) -> bool:
        return parallelism in self.parallelisms

    @property
    def lora(self) -> bool:
        return bool(self.lora_targets)

    def builds(self, model_type: str, *, tied: bool) -> bool:
        """Whether it builds a model of this HF model_type (tied: with tied embeddings)."""
        return (self.model_types is None or model_type in self.model_types) and (self.tied_embeddings or not tied)


TRAIN_ENGINES: SpecRegistry[EngineSpec] = SpecRegistry(
    "training engine", key="strategy",
    builtin_modules=("rlframe.workers.engines.fsdp.spec", "rlframe.workers.engines.megatron.spec"),
    how_to_add="rlframe.plugins.register_train_engine(EngineSpec(...))")


def register_train_engine(spec: EngineSpec) -> EngineSpec:
    """Register a training engine's spec (`<role>.strategy=<spec.name>` selects it)."""
    if not isinstance(spec, EngineSpec):
        raise ValueError(f"register_train_engine takes an EngineSpec, got {type(spec).__name__}")
    return TRAIN_ENGINES.register(spec)


def engine_spec(name: str) -> EngineSpec:
    return TRAIN_ENGINES.get(name)
