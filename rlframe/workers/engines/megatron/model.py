"""A megatron-core `GPTModel` built from a HF config (Llama and Qwen2 families, GQA), and the
model-parallel state it runs in.

- `transformer_config` maps the HF config onto megatron-core's `TransformerConfig`: RMSNorm,
  SwiGLU (gated_linear_unit + silu), GQA (`num_query_groups`), `kv_channels` = head_dim, qkv bias
  for Qwen2, no other biases, no dropout (so megatron and fsdp agree), rope base and Llama-3 rope
  scaling on `GPTModel`. Fusions that need apex or Transformer Engine kernels are off.
- `block_spec`: megatron-core's local (torch) layer spec with a norm that supports sequence
  parallelism. Transformer Engine's spec is left out on purpose: rlframe passes an explicit
  causal + padding mask, which the local `DotProductAttention` takes as is.
- `ValueHead`: the critic's Linear(hidden, 1) in the place of `output_layer` (same call signature),
  replicated over tp; with sequence parallelism it first gathers the sequence.
- `init_model_parallel`: megatron-core keeps one model-parallel state per process, so every
  megatron engine of a process (actor, critic and reference colocated) must use the same (tp, pp).
"""

from __future__ import annotations

import torch

from rlframe.resharding.formats import ModelDims

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def check_hf_config(hf_config, *, tp: int, pp: int, where: str) -> ModelDims:
    """ModelDims of a supported HF config whose shapes split over (tp, pp), else a clear error."""
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: the megatron engine builds {SUPPORTED_MODEL_TYPES} models, not "
                         f"{hf_config.model_type!r}; use strategy=fsdp for other architectures")
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError(f"{where}: tie_word_embeddings=True is not supported by the megatron engine "
                         "(the HF <-> Megatron conversion expects a separate lm_head); use strategy=fsdp")
    dims = ModelDims.from_hf_config(hf_config)
    dims.check_tp(tp)
    problems = [f"{what}({n}) % {by_name}({by}) != 0" for what, n, by_name, by in (
        ("num_attention_heads", dims.num_heads, "tp", tp), ("intermediate_size", dims.intermediate_size, "tp", tp),
        ("vocab_size", dims.vocab_size, "tp", tp), ("num_hidden_layers", dims.num_layers, "pp", pp)) if n % by]
    if problems:
        raise ValueError(f"{where}: the layout tp={tp} pp={pp} does not divide the model: {'; '.join(problems)}")
    return dims


def rope_settings(hf_config) -> dict:
    """GPTModel's rope arguments from a HF config (transformers 5 `rope_parameters` or older fields)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rotary_base": float(theta)}
    if kind == "llama3":
        out.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]))
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported by the megatron engine (default and llama3 are)")
    return out


def transformer_config(hf_config, *, tp: int, pp: int, sequence_parallel: bool, params_dtype: torch.dtype,
                       cpu_init: bool, activation_checkpointing: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dims = ModelDims.from_hf_config(hf_config)
    # Full recompute, each layer its own unit: a layer keeps only its input for the backward.
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1) if activation_checkpointing else {}
    return TransformerConfig(**recompute,
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads, kv_channels=dims.head_dim, ffn_hidden_size=dims.intermediate_size,
        layernorm_epsilon=float(hf_config.rms_norm_eps), normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=dims.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=float(hf_config.initializer_range),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=cpu_init, perform_initialization=False,  # weights come from the HF checkpoint
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        # Micro-batches differ in length; megatron-core allows that only with this dispatcher setting
        # (which has no effect on a dense model).
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
    )


class RMSNorm(torch.nn.RMSNorm):
    """The local spec's norm (torch RMSNorm, same names and numbers) that also runs under sequence
    parallelism, which megatron-core's own torch-norm wrapper refuses.

    Under sequence parallelism each tp rank normalises its own slice of the sequence, so the weight's
    gradient is a partial sum per rank; marking the weight `sequence_parallel` makes megatron-core's
    `finalize_model_grads` all-reduce it over tp before the optimizer step.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def block_spec(config):
    """megatron-core's local (torch) spec for this pipeline stage's layers, with `RMSNorm` as every norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)


class ValueHead(torch.nn.Linear):
    """Linear(hidden, 1) called like megatron's output layer: (hidden (s, b, H)) -> ((s, b, 1), None)."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool):
        super().__init__(hidden_size, 1)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None, **_):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Every tp rank computes the head on the whole sequence; backward keeps its own slice.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return super().forward(hidden), None


def build_model(hf_config, *, head: str, config, pre_process: bool, post_process: bool, device: torch.device):
    """One pipeline stage's GPTModel (this process's tp shard), weights uninitialised."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    model = GPTModel(
        config, block_spec(config), vocab_size=int(hf_config.vocab_size),
        max_sequence_length=int(hf_config.max_position_embeddings), pre_process=pre_process,
        post_process=post_process, parallel_output=True, share_embeddings_and_output_weights=False,
        position_embedding_type="rope", **rope_settings(hf_config),
    )
    if head == "value" and post_process:
        # Named `output_layer` so the HF <-> Megatron conversion maps it to the critic's `score`.
        model.output_layer = ValueHead(config.hidden_size, sequence_parallel=config.sequence_parallel)
    mark_tensor_parallel_weights(model)
    return model.to(device=device, dtype=config.params_dtype)


def mark_tensor_parallel_weights(model) -> None:
    """Give tp-sharded weights megatron-core's `tensor_model_parallel` attributes.

    megatron-core sets them only inside its weight initialisers, which `perform_initialization=False`
    skips (the weights come from the HF checkpoint). Without them the optimizer's gradient norm
    counts a sharded weight on tp rank 0 only, as if it were a replica: the norm (and so clipping)
    is wrong for every tp > 1.
    """
    from megatron.core import tensor_parallel as mtp

    split_dims = ((mtp.ColumnParallelLinear, 0), (mtp.RowParallelLinear, 1), (mtp.VocabParallelEmbedding, 0))
    for module in model.modules():
        for cls, dim in split_dims:
            weight = getattr(module, "weight", None)
            if isinstance(module, cls) and weight is not None and not hasattr(weight, "tensor_model_parallel"):
                mtp.set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def init_model_parallel(*, tp: int, pp: int, seed: int) -> None:
    """Initialise megatron-core's parallel state over the default process group (idempotent)."""
    from megatron.core import parallel_state as ps

    from rlframe.workers.engines.megatron import cpu_compat

    cpu_compat.apply()  # without CUDA: megatron-core's CUDA-only calls go to the CPU (no-op on GPUs)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(
                f"megatron-core's model-parallel state of this process is tp={have[0]} pp={have[1]} but this "
                f"engine asks for tp={tp} pp={pp}; megatron engines that share processes (colocated roles) "
                "must use the same tp and pp"
            )
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    from megatron.core import tensor_parallel

    # The named RNG streams megatron's dropout and recompute fork (on the CPU generator without CUDA)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
