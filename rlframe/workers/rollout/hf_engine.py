"""transformers `generate` rollout engine: the fallback where vLLM is not installed.

Same interface and output as the vLLM engine (rollout/base.py). Each rank runs its own full copy
of the model (no tensor parallelism), so `tensor_parallel_size` must be 1.

Log-probs follow the vLLM engine's `logprobs_mode`: "processed" takes log_softmax of the scores
`generate` sampled from (logits / temperature with top-k/top-p applied; raw logits when greedy),
"raw" takes log_softmax of the unprocessed logits. A sample ends after EOS, a stop token id or the
token that completes a stop string (that token included), like vLLM; tokens `generate` appends
after a sample finished are cut off by the response mask.

LoRA (RolloutConfig.lora_rank > 0, `lora_update(config)` / `update_lora`): the base weights are
never touched or copied. Each targeted projection gets a forward hook adding
`scaling * (x A^T) B^T` to its output, the unmerged form vLLM computes too; a new adapter version
replaces the factors the hooks read (the previous version's tensors are dropped). Because the base
weights stay as they are, `weight_update()` of the base model still works with an adapter live.
Not available when the engine shares a trainer's module (`model=`): that module carries the
trainer's own adapter state.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch

from rlframe.workers.rollout.base import Consumer, RolloutEngine
from rlframe.workers.rollout.batch import assemble_batch, read_prompts, read_row_seeds, to_data_proto
from rlframe.workers.rollout.config import RolloutConfig, SamplingConfig
from rlframe.workers.rollout.lora import lora_param_shapes
from rlframe.workers.rollout.weight_sync import ShardAssembler, WeightSyncStats, timed

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


class HFRolloutEngine(RolloutEngine):
    """Rollout with `model.generate`; `model` may be passed in to share weights with a trainer."""

    backend = "hf"

    def __init__(self, model_path: str, *, config: RolloutConfig, model: torch.nn.Module | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"rollout.backend=hf runs a full model copy per rank: tensor_parallel_size must be 1, "
                f"got {config.tensor_parallel_size}; install vLLM for tensor-parallel generation"
            )
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=_DTYPES.get(config.dtype, torch.float32))
        self.model.eval()
        self._shared_model = model is not None
        self._lora_factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module name -> (A, scaling * B)
        self._lora_hooks: list = []
        self._lora_version = 0
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_token_id = self.model.generation_config.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = self.tokenizer.eos_token_id
        self._last_stats = WeightSyncStats()

    # ------------------------------------------------------------------ generation
    def _stop_ids(self, sampling: SamplingConfig) -> list[int]:
        eos = [] if sampling.ignore_eos or self.eos_token_id is None else (
            list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id])
        return eos + list(sampling.stop_token_ids)

    def _response_length(self, toks: list[int], stop_ids: set[int], stop: tuple[str, ...]) -> int:
        """Tokens up to and including the first stop id / the token completing a stop string."""
        for k, t in enumerate(toks):
            if t in stop_ids:
                return k + 1
            if stop:
                text = self.tokenizer.decode(toks[: k + 1])
                if any(s in text for s in stop):
                    return k + 1
        return len(toks)

    @torch.no_grad()
    def generate(self, prompts: Any, sampling: SamplingConfig) -> Any:
        """See `RolloutEngine.generate`. Sampling uses torch's RNG, forked and seeded when seeds are set.
        With the batch's per-row `seed` tensor (rollout/seeds.py) each row is generated on its own from
        its seed, so a sample does not depend on which rows share the call; else one seed for the call."""
        ids, mask = read_prompts(prompts)
        batch = prompts.batch if hasattr(prompts, "batch") else prompts
        t0 = time.perf_counter()
        if "seed" in batch.keys() and not sampling.greedy:
            responses, log_probs = [], []
            for b, seed in enumerate(read_row_seeds(prompts, sampling)):
                keep = mask[b].bool()
                r, lp = self._sample(ids[b:b + 1, keep], mask[b:b + 1, keep], sampling, seed=seed)
                responses += r
                log_probs += lp
        else:
            responses, log_probs = self._sample(ids, mask, sampling, seed=sampling.seed)
        gen_s = time.perf_counter() - t0
        tensors = assemble_batch(prompt_ids=ids, prompt_mask=mask, responses=responses, log_probs=log_probs,
                                 n=sampling.n, response_length=sampling.max_new_tokens,
                                 pad_token_id=self.pad_token_id)
        return to_data_proto(tensors, meta_info={"rollout_backend": self.backend, "gen_time_s": gen_s,
                                                 "gen_tokens": int(tensors["response_mask"].sum()),
                                                 "lora_version": self._lora_version})

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig, *, seed: int | None
                ) -> tuple[list[list[int]], list[list[float]]]:
        """n samples of each row of (ids, mask): their tokens up to the stop, and each token's log-prob."""
        device = next(self.model.parameters()).device
        stop_ids = self._stop_ids(sampling)
        kwargs = dict(
            max_new_tokens=sampling.max_new_tokens, num_return_sequences=sampling.n,
            do_sample=not sampling.greedy, pad_token_id=self.pad_token_id, eos_token_id=stop_ids or None,
            return_dict_in_generate=True, output_scores=self.config.logprobs_mode == "processed",
            output_logits=self.config.logprobs_mode == "raw",
        )
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=None if sampling.top_k == -1 else sampling.top_k)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.tokenizer)
        with torch.random.fork_rng(devices=[]) if seed is not None else nullcontext():
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        gen = out.sequences[:, ids.shape[1]:].cpu()
        scores = out.scores if self.config.logprobs_mode == "processed" else out.logits
        # (B*n, T, V) -> log-prob of each generated token under the distribution it came from.
        lp = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in scores], dim=1).cpu()
        lp = lp.gather(-1, gen.unsqueeze(-1)).squeeze(-1)
        responses, log_probs = [], []
        stop_set = set(stop_ids)
        for row, row_lp in zip(gen.tolist(), lp.tolist()):
            k = self._response_length(row, stop_set, sampling.stop)
            responses.append(row[:k])
            log_probs.append(row_lp[:k])
        return responses, log_probs

    # ------------------------------------------------------------------ weights
    @property
    def last_sync_stats(self) -> WeightSyncStats:
        return self._last_stats

    @contextmanager
    def weight_update(self) -> Iterator[Consumer]:
        """Pieces are copied straight into the parameters (full boxes: there is no TP here)."""
        from rlframe.resharding.box import Box

        params = dict(self.model.named_parameters())
        assembler = ShardAssembler(needed={n: Box.full(p.shape) for n, p in params.items()},
                                   full_shapes={n: tuple(p.shape) for n, p in params.items()},
                                   full_shape_buffers=False)
        self._last_stats = assembler.stats

        def consume(pieces):
            with timed(assembler.stats), torch.no_grad():
                for name, _, t in assembler.add(pieces):
                    params[name].data.copy_(t)

        yield consume
        assembler.check_complete()

    # ------------------------------------------------------------------ checking a sync
    def weight_slice_digests(self, boxes=None) -> list:
        """See `RolloutEngine.weight_slice_digests`: every parameter is held whole (its box is the
        full tensor), in the model's dtype."""
        from rlframe.resharding.box import Box
        from rlframe.workers.rollout.checksum import slice_digests

        with torch.no_grad():
            read = {n: (Box.full(p.shape), p.data) for n, p in self.model.named_parameters()}
            return slice_digests(read, boxes)

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def lora_version(self) -> int:
        """How many adapter versions were loaded (0: the base model only)."""
        return self._lora_version

    def _adapter_spec(self, config):
        if self.config.lora_rank > 0 and self._shared_model:
            raise ValueError("the hf rollout engine shares the trainer's module (model=...): its adapter is the "
                             "trainer's; build the engine from model_path to serve adapters sent by lora_update()")
        return super()._adapter_spec(config)

    def lora_shapes(self, config=None) -> dict[str, tuple[int, int]]:
        """{adapter factor name: shape} of an adapter with `config` (rollout/lora.py)."""
        spec = self._adapter_spec(config)
        return lora_param_shapes({n: tuple(p.shape) for n, p in self.model.named_parameters()},
                                 rank=spec.rank, target_modules=spec.target_modules)

    def lora_needed_boxes(self, config=None) -> dict:
        """Full boxes of every factor (no tensor parallelism here)."""
        from rlframe.resharding.box import Box

        return {n: Box.full(s) for n, s in self.lora_shapes(config).items()}

    @contextmanager
    def lora_update(self, config=None) -> Iterator[Consumer]:
        """Yield `consume(pieces)` for one adapter version; on exit the hooks use it (module docstring)."""
        from rlframe.resharding.box import Box

        spec = self._adapter_spec(config)
        shapes = lora_param_shapes({n: tuple(p.shape) for n, p in self.model.named_parameters()},
                                   rank=spec.rank, target_modules=spec.target_modules)
        assembler = ShardAssembler(needed={n: Box.full(s) for n, s in shapes.items()}, full_shapes=shapes,
                                   full_shape_buffers=False)
        self._last_stats = assembler.stats
        received: dict[str, torch.Tensor] = {}

        def consume(pieces):
            with timed(assembler.stats), torch.no_grad():
                for name, _, t in assembler.add(pieces):
                    received[name] = t

        yield consume
        assembler.check_complete()
        with timed(assembler.stats), torch.no_grad():
            modules = dict(self.model.named_modules())
            factors = {}
            for name in shapes:
                if name.endswith(".lora_A.weight"):
                    stem = name[: -len(".lora_A.weight")]
                    weight = modules[stem].weight
                    a = received[name].to(device=weight.device, dtype=weight.dtype)
                    b = (received[f"{stem}.lora_B.weight"] * spec.scaling).to(device=weight.device, dtype=weight.dtype)
                    factors[stem] = (a, b)
            self._install_hooks(modules, factors)
        self._lora_version += 1

    def _install_hooks(self, modules: dict, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for handle in self._lora_hooks:
            handle.remove()
        self._lora_factors = factors
        self._lora_hooks = [modules[stem].register_forward_hook(self._lora_hook(stem)) for stem in factors]

    def _lora_hook(self, stem: str):
        def hook(module, args, output):
            a, b = self._lora_factors[stem]
            return output + torch.nn.functional.linear(torch.nn.functional.linear(args[0], a), b)
        return hook
