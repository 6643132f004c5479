"""vLLM rollout engine living inside the worker process (no server, no extra process).

Build: `VLLMRolloutEngine(model_path, config=RolloutConfig(...))` on every rank of the generation
group. TP > 1 (or several data-parallel engines in one process group) uses vLLM's
`external_launcher` executor: vLLM joins the already initialised torch.distributed group
(RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, gloo on CPU). The ranks of a TP group each run their own
scheduler on the same prompts and stay in lockstep because scheduling is deterministic; the
data-parallel replicas of a dense model step at their own pace (`vllm_adapt.replicas_at_own_pace`).
That needs
`VLLM_ENABLE_V1_MULTIPROCESSING=0` (the engine core in this process), which is set here.

Weight sync (`weight_update()` / `update_weights()`), two paths:
- kernel format (the default): the rank's shards are fused into vLLM's per-rank tensors
  (`qkv_proj`, `gate_up_proj`, padded vocab) and copied in place into the parameters the forward
  reads (`kernel_format.py`); on GPU these are the tensors CUDA graphs captured. On CPU it works
  because the engine keeps vLLM's linear layers on plain `F.linear` over their parameters
  (`vllm_adapt.plain_cpu_linears`) instead of vLLM's oneDNN copies of them.
- checkpoint format (`kernel_format=False`): HF names, and per parameter a tensor of the full HF
  shape with this rank's box written (`weight_sync.ShardAssembler`), fed through vLLM's layer-wise
  reload (`vllm/model_executor/model_loader/reload/`, the code behind
  `model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`) one bucket at a
  time: layers are restored to checkpoint format, each completed parameter goes to
  `model.load_weights`, and vLLM re-processes a layer as soon as all of its weights arrived, so at
  most about one layer is held unprocessed. For weights whose kernel format vLLM derives
  (quantised or repacked layers).
After either path the prefix cache is reset (its KV entries were computed with the old weights).

Checking a sync (`weight_checksums()`, rollout/checksum.py): every slice of `needed_boxes` is read
back from the live parameters (q/k/v and gate/up un-fused by the parts' row counts, vocabulary
padding dropped) and hashed in the engine's dtype; a layer whose tensors are not a plain copy of the
weights (quantised, or shaped unlike the kernel layout) is reported unverifiable. LoRA adapters are
not read back (`unchecked_weights`).

LoRA (RolloutConfig.lora_rank > 0): vLLM is built with `enable_lora=True, max_loras=1` and the
trainer sends only the adapter each step, `lora_update(config)` / `update_lora(...)`
(rollout/lora.py says which boxes a TP rank needs: its slice of B for q/k/v/gate/up and of A for
o/down, the other factor in full). The adapter goes from memory into vLLM, no file is written: the
factors are assembled in full-shape buffers (only the rank's box written, as for base weights),
B is pre-multiplied by the scaling inside the box, a `vllm.lora.lora_model.LoRAModel` is built with
`LoRAModel.from_lora_tensors` and registered directly in the worker's LoRA model manager
(`model_runner.lora_manager._adapter_manager.add_adapter`) under a new `lora_int_id` after every
older adapter was removed. `generate` then sends a `LoRARequest` with that id; since the id is
already registered, vLLM's worker manager only activates it (it would read `lora_path` only for an
unknown id, and the path given is a label, not a file). vLLM slices each factor to the rank's part
when it copies it into its stacked buffers (`set_lora`). Each version also has its own
`lora_name`, which is part of vLLM's prefix-cache block hash, and the prefix cache is reset after
every update, so no KV computed under an older adapter is reused.

Log-probs: `SamplingParams(logprobs=0)` returns the sampled token's log-prob. vLLM 0.32 computes it
from the raw logits by default (`logprobs_mode="raw_logprobs"`: no temperature); the engine asks for
`"processed_logprobs"` (RolloutConfig.logprobs_mode="processed"): log_softmax(logits / T) after
top-k/top-p masking, the distribution the token was drawn from. Without top-k/top-p that is the
actor's `logits / T` convention (tests: mean |diff| vs a transformers forward < 1e-3 in fp32).
Greedy requests get log_softmax of the raw logits in both modes.

Memory around training: `sleep()` discards the KV cache and offloads weights (vLLM sleep mode,
level 1) and `wake()` re-creates them, on backends with sleep mode (CUDA/ROCm/XPU). The CPU backend
has no sleep mode: `sleep()` is then a no-op and memory stays bounded by `kv_cache_bytes`.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch

from rlframe.resharding.formats import ModelDims
from rlframe.workers.rollout.base import Consumer, RolloutEngine
from rlframe.workers.rollout.batch import assemble_batch, read_prompts, read_row_seeds, to_data_proto, unpad_prompts
from rlframe.workers.rollout.config import RolloutConfig, SamplingConfig
from rlframe.workers.rollout.lora import PEFT_PREFIX, AdapterSpec, lora_needed_boxes, lora_param_shapes
from rlframe.workers.rollout.vllm_adapt import (
    check_vllm_version,
    eager_token_ranks,
    llm_kwargs,
    own_pace_steps,
    plain_cpu_linears,
    remove_stale_cpu_shm,
    replicas_at_own_pace,
    sleep_level,
)
from rlframe.workers.rollout.weight_sync import (
    ShardAssembler,
    WeightSyncStats,
    timed,
    vllm_needed_boxes,
)

logger = logging.getLogger(__name__)



def _model_runner(worker):
    """Runs on vLLM's worker (in this process): hand back its model runner."""
    return worker.model_runner


def hf_param_shapes(model_path: str) -> tuple[dict[str, tuple[int, ...]], Any]:
    """{HF parameter name: global shape} of the checkpoint at `model_path` (meta device, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}, cfg


# KV-cache block on CPU: the smallest vLLM's CPU attention takes. Its attention and cache writes
# work on whole blocks, so vLLM's CPU default of 128 costs short sequences: 128 samples x 16 new
# tokens of the 12m preset generate in 0.87-0.92 s with 32 against 1.61-1.64 s with 128 (64: 1.08,
# 256: 2.25), and 200-token samples still in 16.0 against 19.0 s (one thread, 2026-11-23).
CPU_BLOCK_SIZE = 32


def cpu_settings(config: RolloutConfig, dims: ModelDims) -> RolloutConfig:
    """`config` with the CPU defaults made explicit: blocks of CPU_BLOCK_SIZE tokens, and a KV cache
    of `kv_cache_bytes` but no more than what max_num_seqs sequences of max_model_len tokens take
    on this rank (one spare sequence), so a small model does not zero (and page in) a cache it
    cannot fill: for the demo model 64 MiB instead of 256, 0.6 s less of each worker's start-up.
    Models whose KV is smaller per token than full attention with `num_key_value_heads` (MLA,
    sliding windows) get more than they need."""
    block = config.block_size or CPU_BLOCK_SIZE
    kv_bytes = config.kv_cache_bytes
    if kv_bytes is not None:
        tokens = (config.max_num_seqs + 1) * -(-config.max_model_len // block) * block
        kv_heads = max(1, dims.num_kv_heads // config.tensor_parallel_size)
        elem = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
        kv_bytes = min(kv_bytes, dims.num_layers * 2 * kv_heads * dims.head_dim * elem * tokens)
    return replace(config, block_size=block, kv_cache_bytes=kv_bytes)


class VLLMRolloutEngine(RolloutEngine):
    """In-process vLLM engine; see the module docstring for the dataflow."""

    backend = "vllm"

    def __init__(self, model_path: str, *, config: RolloutConfig, cpu_threads_bind: str = "nobind"):
        """cpu_threads_bind: VLLM_CPU_OMP_THREADS_BIND for the CPU backend. "nobind" keeps the
        process's own torch threads (the engine shares the process with training); "auto" lets vLLM
        pin one core per rank and reserve the others."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        remove_stale_cpu_shm()
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_threads_bind)
        import vllm
        from vllm import LLM
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        check_vllm_version(vllm.__version__)
        self.model_path = str(model_path)
        self.tp = config.tensor_parallel_size
        self.is_cpu = current_platform.is_cpu()
        self._shapes, hf_cfg = hf_param_shapes(self.model_path)
        dims = ModelDims.from_hf_config(hf_cfg)
        if self.is_cpu:
            eager_token_ranks()
            plain_cpu_linears()
            config = cpu_settings(config, dims)
        self.config = config
        self.sleep_supported = current_platform.is_sleep_mode_available()
        kwargs = llm_kwargs(self.model_path, config, is_cpu=self.is_cpu, sleep_supported=self.sleep_supported)
        # vLLM's CPU worker replaces torch.set_num_threads process-wide; the training engine in this
        # process must keep control of its threads, so the original is put back.
        set_num_threads = torch.set_num_threads
        # vLLM runs three full garbage collections while it builds the engine (1.1 s of CPU in a worker
        # that imported torch, transformers and vLLM). What is alive now (modules, the training
        # engine) lives as long as the process: frozen, it is left out of every later collection.
        gc.freeze()
        try:
            self.llm = LLM(**kwargs)
        except TypeError as err:
            if any(f"'{key}'" in str(err) for key in config.vllm_kwargs):
                raise ValueError(f"rollout.engine_kwargs={config.vllm_kwargs}: vLLM {vllm.__version__} refused them "
                                 f"({err}); use keywords of vllm.EngineArgs") from err
            raise
        finally:
            torch.set_num_threads = set_num_threads
        self._own_pace = replicas_at_own_pace(self.llm)
        self.tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._runner = self.llm.collective_rpc(_model_runner)[0]
        self._tp_rank = get_tensor_model_parallel_rank() if self.tp > 1 else 0
        self._num_kv_heads, self._head_dim = dims.num_kv_heads, dims.head_dim
        self._needed = vllm_needed_boxes(self._shapes, tp_rank=self._tp_rank, tp_size=self.tp,
                                         num_kv_heads=self._num_kv_heads, head_dim=self._head_dim)
        self._last_stats = WeightSyncStats()
        self._lora_version = 0  # lora_int_id of the adapter being served (0: none yet)
        self._lora_request = None
        self._lora_model = None  # the LoRAModel of that adapter, handed back whenever vLLM reloads it
        if config.load_format == "dummy":
            self._weights_missing = "was started with dummy weights (load_format=dummy)"

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, sampling: SamplingConfig, seed: int | None):
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens, stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None, ignore_eos=sampling.ignore_eos,
            seed=seed, logprobs=0, detokenize=bool(sampling.stop),
        )

    def generate(self, prompts: Any, sampling: SamplingConfig) -> Any:
        """See `RolloutEngine.generate`. Seeds: the batch's per-row `seed` tensor when it has one (sample
        j of row b uses seed[b] + j: rollout/seeds.py), else prompt b uses sampling.seed + b*n."""
        from vllm.inputs import TokensPrompt

        self.require_awake(("weights", "kv_cache"), doing="generate()")
        self.require_weights(doing="generate()")
        ids, mask = read_prompts(prompts)
        token_lists = unpad_prompts(ids, mask)
        seeds = read_row_seeds(prompts, sampling)
        if seeds is None:
            params = self._sampling_params(sampling, None)
        else:
            params = [self._sampling_params(sampling, s) for s in seeds]
        t0 = time.perf_counter()
        with own_pace_steps(self._own_pace):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=t) for t in token_lists],
                                        sampling_params=params, use_tqdm=False, lora_request=self._lora_request)
        gen_s = time.perf_counter() - t0
        responses, log_probs = [], []
        for out in outputs:
            for comp in sorted(out.outputs, key=lambda c: c.index):
                toks = list(comp.token_ids)
                responses.append(toks)
                log_probs.append([comp.logprobs[k][t].logprob for k, t in enumerate(toks)])
        tensors = assemble_batch(prompt_ids=ids, prompt_mask=mask, responses=responses, log_probs=log_probs,
                                 n=sampling.n, response_length=sampling.max_new_tokens,
                                 pad_token_id=self.pad_token_id)
        n_tok = int(tensors["response_mask"].sum())
        return to_data_proto(tensors, meta_info={"rollout_backend": self.backend, "gen_time_s": gen_s,
                                                 "gen_tokens": n_tok, "lora_version": self._lora_version})

    # ------------------------------------------------------------------ weights
    @property
    def needed_boxes(self) -> dict:
        """{HF name: Box} this rank must receive per update (what the resharding planner must deliver)."""
        return dict(self._needed)

    @property
    def last_sync_stats(self) -> WeightSyncStats:
        return self._last_stats

    @contextmanager
    def weight_update(self, *, kernel_format: bool = True, outside_fill: float | None = None
                      ) -> Iterator[Consumer]:
        """Yield `consume(pieces)`; see the module docstring for the two paths.

        kernel_format: copy in place into vLLM's tensors (True) or go through vLLM's layer-wise reload.
        outside_fill: value for the part of full-shape buffers outside this rank's box (None: left
            uninitialised, no memory touched; tests pass NaN to prove vLLM never reads it).
        """
        self.require_awake(("weights",), doing="a weight update")
        assembler = ShardAssembler(needed=self._needed, full_shapes=self._shapes,
                                   full_shape_buffers=not kernel_format, fill=outside_fill)
        self._last_stats = assembler.stats
        try:
            if kernel_format:
                with self._kernel_format_update(assembler) as consume:
                    yield consume
            else:
                with self._checkpoint_format_update(assembler) as consume:
                    yield consume
            self._weights_missing = None  # both paths checked on exit that every weight was written
        finally:  # even a sync that failed half-way may have written weights: no KV of the old ones is reused
            self._reset_prefix_cache()

    @contextmanager
    def _checkpoint_format_update(self, assembler: ShardAssembler) -> Iterator[Consumer]:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self._runner.get_model()
        stats = assembler.stats

        def consume(pieces):
            with timed(stats), torch.no_grad():
                done = assembler.add(pieces)
                if done:
                    model.load_weights((name, t) for name, _, t in done)

        with timed(stats), torch.no_grad():
            initialize_layerwise_reload(model)
        try:
            yield consume
        finally:
            with timed(stats), torch.no_grad():
                finalize_layerwise_reload(model, self._runner.vllm_config.model_config)
        assembler.check_complete()

    @contextmanager
    def _kernel_format_update(self, assembler: ShardAssembler) -> Iterator[Consumer]:
        from rlframe.workers.rollout.kernel_format import KernelFormatFuser, copy_into_kernel_params

        model = self._runner.get_model()
        fuser = KernelFormatFuser()
        stats = assembler.stats

        def consume(pieces):
            with timed(stats), torch.no_grad():
                for name, _, t in assembler.add(pieces):
                    copy_into_kernel_params(model, fuser.add(name, t))

        yield consume
        assembler.check_complete()
        fuser.check_complete()

    # ------------------------------------------------------------------ checking a sync
    def weight_slice_digests(self, boxes=None) -> list:
        """See `RolloutEngine.weight_slice_digests`: this rank's `needed_boxes`, read back from the
        parameters the forward reads (rollout/checksum.py undoes the fusing and the vocab padding)."""
        from rlframe.workers.rollout.checksum import hf_slice_of_kernel_param, slice_digests

        self.require_awake(("weights",), doing="reading the weights back")
        model = self._runner.get_model()
        read = {}
        for name, held in self._needed.items():
            if not held.empty:
                found = _kernel_param(model, name)
                read[name] = (held, found if isinstance(found, str) else
                              hf_slice_of_kernel_param(name, self._needed, found))
        with torch.no_grad():
            return slice_digests(read, boxes)

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def lora_version(self) -> int:
        """lora_int_id of the adapter `generate` uses (0: the base model, no adapter loaded yet)."""
        return self._lora_version

    def lora_shapes(self, config=None) -> dict[str, tuple[int, int]]:
        """{adapter factor name: global shape} of an adapter with `config` (rollout/lora.py)."""
        spec = self._adapter_spec(config)
        return lora_param_shapes(self._shapes, rank=spec.rank, target_modules=spec.target_modules)

    def lora_needed_boxes(self, config=None) -> dict:
        """{adapter factor name: Box} this rank must receive per `lora_update(config)`."""
        return lora_needed_boxes(self.lora_shapes(config), tp_rank=self._tp_rank, tp_size=self.tp,
                                 num_kv_heads=self._num_kv_heads, head_dim=self._head_dim)

    @contextmanager
    def lora_update(self, config=None, *, outside_fill: float | None = None) -> Iterator[Consumer]:
        """Yield `consume(pieces)` for one adapter version; on exit the adapter is live (module docstring).

        outside_fill: value for the part of full-shape factor buffers outside this rank's box
            (None: left uninitialised; tests pass NaN to prove vLLM never reads it).
        """
        self.require_awake(("weights",), doing="a LoRA update")
        spec = self._adapter_spec(config)
        shapes = lora_param_shapes(self._shapes, rank=spec.rank, target_modules=spec.target_modules)
        needed = lora_needed_boxes(shapes, tp_rank=self._tp_rank, tp_size=self.tp,
                                   num_kv_heads=self._num_kv_heads, head_dim=self._head_dim)
        assembler = ShardAssembler(needed=needed, full_shapes=shapes, full_shape_buffers=True, fill=outside_fill)
        self._last_stats = assembler.stats
        tensors: dict[str, torch.Tensor] = {}

        def consume(pieces):
            with timed(assembler.stats), torch.no_grad():
                for name, box, t in assembler.add(pieces):
                    if name.endswith(".lora_B.weight"):
                        t[box.slices()] *= spec.scaling  # only the box: the rest is never read
                    tensors[PEFT_PREFIX + name] = t

        try:
            yield consume
            assembler.check_complete()
            with timed(assembler.stats), torch.no_grad():
                self._install_adapter(tensors, spec)
        finally:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """Drop every cached KV block after the weights changed. vLLM refuses (False) while a request
        still holds blocks, which would let blocks computed with the old weights serve later prompts."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM kept its prefix cache after a weight update because requests still hold KV "
                               "blocks (a generate that did not finish?); later prompts could reuse KV computed "
                               "with the old weights")

    def _install_adapter(self, tensors: dict[str, torch.Tensor], spec: AdapterSpec) -> None:
        """Register the adapter in vLLM's worker LoRA manager under a new id; drop every older one."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        worker_manager = self._runner.lora_manager
        manager = worker_manager._adapter_manager
        # lora_alpha = r: scaling 1 in vLLM, the real scaling is already in B (see lora_update).
        helper = PEFTHelper.from_dict({"r": spec.rank, "lora_alpha": spec.rank,
                                       "target_modules": list(spec.target_modules)})
        helper.validate_legal(worker_manager.lora_config)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        version = self._lora_version + 1
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=version, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=worker_manager.lora_config.lora_dtype, model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        worker_manager.remove_all_adapters()
        manager.add_adapter(lora)
        if self._lora_model is None:
            _serve_from_memory(worker_manager, self)
        self._lora_model = lora
        self._lora_version = version
        self._lora_request = LoRARequest(lora_name=f"rlframe-lora-v{version}", lora_int_id=version,
                                         lora_path=f"rlframe-in-memory://lora-v{version}")

    def _in_memory_adapter(self, request):
        """The LoRAModel for `request` when it is the adapter being served, else None."""
        if self._lora_model is not None and request.lora_int_id == self._lora_version:
            return self._lora_model
        return None

    # ------------------------------------------------------------------ memory
    def _release(self, *, full_sync_next: bool) -> tuple[str, ...]:
        """Discard the KV cache and offload the weights to host memory (level 1) or drop them (level 2,
        when a full sync follows: `vllm_adapt.sleep_level`); nothing on CPU (no sleep mode)."""
        level = sleep_level(lora=self.config.lora_rank > 0, full_sync_next=full_sync_next,
                            sleep_supported=self.sleep_supported)
        if level == 0:
            logger.info("vLLM's %s backend has no sleep mode: the KV cache (%s bytes) stays allocated",
                        "CPU" if self.is_cpu else "current", self.config.kv_cache_bytes)
            return ()
        self.llm.sleep(level=level)
        if level == 2:
            self._weights_missing = "dropped its weights in sleep level 2"
        return ("weights", "kv_cache")

    def _reacquire(self, tags: tuple[str, ...]) -> None:
        self.llm.wake_up(tags=list(tags))

    def shutdown(self) -> None:
        """Drop the engine. Call it only when the worker is done with torch.distributed too: vLLM's
        teardown (EngineCore.shutdown -> cleanup_dist_env_and_memory) also destroys the default
        process group it joined, which is the worker's own group under external_launcher."""
        if getattr(self, "llm", None) is not None:
            self._runner = None
            del self.llm


def _kernel_param(model, name: str):
    """vLLM's parameter holding HF parameter `name` (inside a LoRA wrapper too), or why there is none
    it can be read back from (a missing module, a quantised layer whose tensor is derived)."""
    from rlframe.workers.rollout.checksum import kernel_name

    module_name, _, leaf = kernel_name(name).rpartition(".")
    try:
        module = model.get_submodule(module_name)
        module = getattr(module, "base_layer", module)  # vLLM's LoRA layers wrap the base layer
        param = module.get_parameter(leaf)
    except AttributeError as err:
        return f"vLLM has no parameter {kernel_name(name)} ({err})"
    method = getattr(module, "quant_method", None)
    if method is not None and not type(method).__name__.startswith("Unquantized"):
        return f"{module_name} computes with {type(method).__name__}: its tensors are derived, not a copy"
    return param.data


def _serve_from_memory(worker_manager, engine: VLLMRolloutEngine) -> None:
    """Let vLLM's worker LoRA manager reload the served adapter from memory. vLLM drops every adapter
    after a dummy step (`maybe_dummy_run_with_lora`: a data-parallel replica of a mixture-of-experts
    model with no requests of its own steps in lockstep with the others), and loads a requested
    adapter it does not hold from `lora_path`; for the in-memory adapter that path is only a label,
    so the load is answered here."""
    load_from_path = worker_manager._load_adapter

    def load(request):
        lora = engine._in_memory_adapter(request)
        return lora if lora is not None else load_from_path(request)

    worker_manager._load_adapter = load
