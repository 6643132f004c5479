"""The rollout engine interface every backend implements (vLLM, transformers).

    engine.generate(prompts, sampling) -> DataProto   # contract keys, see rollout/batch.py
    with engine.weight_update() as consume:          # push style, for the resharding executor
        execute_plan(plan, local=shards, consumer=consume)
    engine.update_weights(state_dict_or_buckets)      # pull style: a full HF state dict, an iterator
                                                      #   of (name, tensor), or of buckets of pieces
    with engine.lora_update({"r": 8, "lora_alpha": 16}) as consume:  # adapter-only sync (lora_rank > 0):
        execute_plan(plan, local=adapter_shards, consumer=consume)   #   lora_A/lora_B pieces, see rollout/lora.py
    engine.update_lora(adapter_state_dict, config)    # pull style of the same
    engine.sleep(full_sync_next=True); ...train...    # hand memory to the training engine (a full
                                                      #   sync follows: the weights may be dropped), then
    engine.wake(("weights",)); <sync>; engine.wake(("kv_cache",))  # weights back first, then the cache
    engine.awaits_full_sync                           # True: generate() is refused until a full sync
                                                      #   (dummy weights at start, or dropped by sleep)
    engine.weight_checksums()                         # {"name[lo:hi,...]": sha256} of the slices it holds,
                                                      #   read back (rollout/checksum.py)
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from rlframe.workers.rollout.config import SamplingConfig
from rlframe.workers.rollout.weight_sync import Piece, WeightSyncStats, full_state_dict_pieces

Consumer = Callable[[list[Piece]], None]

# What `sleep` may release, in the order `wake` gives it back: the weights must be resident before a
# sync writes them (on GPU vLLM's sleep offloads them; waking later would restore the stale copy), and
# the KV cache is only needed to generate, so it comes back last, after the sync's buffers are freed.
MEMORY_TAGS = ("weights", "kv_cache")


def as_buckets(weights: Any) -> Iterator[list[Piece]]:
    """Normalise the accepted weight sources to an iterator of buckets `[(name, Box, tensor)]`.

    Accepts a `{name: tensor}` mapping, an iterable of `(name, tensor)` pairs, or an iterable of
    buckets (lists of `(name, Box, tensor)`), as the resharding executor produces.
    """
    if isinstance(weights, Mapping):
        yield from full_state_dict_pieces(weights)
        return
    it = iter(weights)
    first = next(it, None)
    if first is None:
        return
    it = itertools.chain([first], it)
    if isinstance(first, tuple) and len(first) == 2 and isinstance(first[1], torch.Tensor):
        yield from full_state_dict_pieces(it)
    elif isinstance(first, list):
        yield from it
    else:
        raise ValueError(
            f"update_weights got an iterable of {type(first).__name__}; pass a {{name: tensor}} dict, "
            "(name, tensor) pairs, or buckets [(name, Box, tensor), ...]"
        )


class RolloutEngine(ABC):
    """A generation backend living inside a worker process."""

    backend: str = ""
    spec = None  # its rlframe.plugins.BackendSpec, set by build_rollout_engine

    @abstractmethod
    def generate(self, prompts: Any, sampling: SamplingConfig) -> Any:
        """Sample `sampling.n` responses per prompt.

        prompts: DataProto or dict with left-padded `input_ids` and `attention_mask` (B, P).
        Returns a DataProto with prompts (B*n, P), responses/response_mask/rollout_log_probs
        (B*n, R=max_new_tokens), input_ids/attention_mask/position_ids (B*n, P+R); the n samples
        of a prompt are adjacent.
        """

    @abstractmethod
    @contextmanager
    def weight_update(self) -> Iterator[Consumer]:
        """Context yielding a consumer `consume(pieces)` called once per bucket; on exit every
        parameter must have been received completely, and the new weights are live."""

    @property
    @abstractmethod
    def last_sync_stats(self) -> WeightSyncStats:
        """Measurements of the most recent weight update."""

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable) -> WeightSyncStats:
        """Load new weights from a state dict, (name, tensor) pairs or buckets of pieces."""
        with self.weight_update() as consume:
            for bucket in as_buckets(weights):
                consume(bucket)
        return self.last_sync_stats

    @contextmanager
    def lora_update(self, config: Mapping | None = None) -> Iterator[Consumer]:
        """Context yielding `consume(pieces)` for one adapter version (lora_A/lora_B factors named
        `model.layers.{i}.<module>.<proj>.lora_A.weight`); on exit every factor must have been received
        and the next `generate` uses this adapter and no earlier one. `config`: the adapter's settings
        (rollout/lora.py). Only engines built with RolloutConfig.lora_rank > 0."""
        raise NotImplementedError(
            f"the {self.backend or type(self).__name__} rollout engine cannot serve LoRA adapters; build it with "
            "lora_rank=0 and sync merged weights (W + scaling * B @ A) with weight_update()")
        yield  # pragma: no cover

    def _adapter_spec(self, config):
        """The AdapterSpec of `config` with this engine's defaults, checked against what it was built for."""
        from rlframe.workers.rollout.lora import adapter_spec

        if self.config.lora_rank <= 0:
            raise ValueError(f"this {self.backend} rollout engine was built without LoRA (rollout.lora_rank=0): set "
                             "rollout.lora_rank to the adapter's rank, or sync merged weights with weight_update()")
        spec = adapter_spec(config, default_rank=self.config.lora_rank, default_alpha=self.config.lora_alpha,
                            default_targets=self.config.lora_target_modules)
        if spec.rank > self.config.lora_rank:
            raise ValueError(f"adapter rank {spec.rank} > rollout.lora_rank={self.config.lora_rank} the engine was "
                             "built for; raise rollout.lora_rank")
        return spec

    def update_lora(self, adapter: Mapping[str, torch.Tensor] | Iterable, config: Mapping | None = None
                    ) -> WeightSyncStats:
        """Load a new adapter version from a {factor name: tensor} dict, (name, tensor) pairs or buckets."""
        with self.lora_update(config) as consume:
            for bucket in as_buckets(adapter):
                consume(bucket)
        return self.last_sync_stats

    # ---- checking a sync: what the engine holds, read back (rollout/checksum.py)
    def weight_slice_digests(self, boxes: Mapping | None = None) -> list:
        """[SliceDigest] of every HF parameter's slice this rank holds (or of `boxes`, {name: global Box}
        inside those slices), read back from the live weights in HF coordinates and hashed in the
        engine's dtype; a slice that cannot be read back is reported unverifiable."""
        raise NotImplementedError(f"the {self.backend or type(self).__name__} rollout engine cannot read its "
                                  "weights back for a checksum; implement weight_slice_digests")

    def weight_checksums(self, boxes: Mapping | None = None) -> dict[str, str]:
        """{`name[lo:hi,...]`: sha256 hex (or "unverifiable: why")} of `weight_slice_digests(boxes)`."""
        return {d.key: d.digest for d in self.weight_slice_digests(boxes)}

    _lora_version = 0  # the adapter being served (0: none); engines with LoRA count their updates here

    def unchecked_weights(self) -> list[str]:
        """What `weight_checksums` does not cover though a sync writes it: a LoRA adapter (synced, but
        only the base weights are read back)."""
        if self._lora_version == 0:
            return []
        return [f"LoRA adapter v{self._lora_version}: adapters are synced but not read back (only base weights are "
                "checksummed)"]

    _sleeping: frozenset = frozenset()  # the MEMORY_TAGS `sleep` released and `wake` has not given back
    # Why the engine holds no usable weights (None: it does): it was built with dummy weights, or a
    # sleep dropped them. Only a complete full-weight update (`weight_update`) gives it weights again.
    _weights_missing: str | None = None

    @property
    def awaits_full_sync(self) -> bool:
        """True while `generate` is refused until a complete `weight_update` (see `_weights_missing`)."""
        return self._weights_missing is not None

    def require_weights(self, *, doing: str) -> None:
        """Raise when the engine holds no usable weights: generating from them would give garbage."""
        if self._weights_missing is not None:
            raise RuntimeError(f"{doing} before a weight sync: the rollout engine {self._weights_missing}, so it "
                               "would generate from meaningless weights. Sync the trainer's full weights first "
                               "(weight_update / update_weights), or start the engine with the checkpoint's "
                               "weights (rollout.load_format=real)")

    def sleep(self, *, full_sync_next: bool = False) -> None:
        """Release generation memory (weights, KV cache) while training runs. full_sync_next: the caller
        writes every weight (`weight_update`) before it generates again, so the engine may drop its
        weights instead of keeping a copy; it then `awaits_full_sync` until that update."""
        self._sleeping = frozenset(self._release(full_sync_next=full_sync_next))

    @property
    def sleeping(self) -> frozenset:
        """The MEMORY_TAGS released by `sleep` and not given back by `wake` yet."""
        return self._sleeping

    def wake(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        """Re-acquire what `sleep` released of `tags` ("weights" before a weight sync, "kv_cache" before
        `generate`)."""
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"wake tags {sorted(unknown)} unknown; choose from {MEMORY_TAGS}")
        pending = tuple(t for t in MEMORY_TAGS if t in tags and t in self._sleeping)
        if pending:
            self._reacquire(pending)
            self._sleeping = self._sleeping - set(pending)

    def require_awake(self, tags: tuple[str, ...], *, doing: str) -> None:
        """Raise when `doing` needs memory `sleep` released (a weight write into offloaded weights
        would be lost or fault)."""
        asleep = [t for t in tags if t in self._sleeping]
        if asleep:
            raise RuntimeError(f"{doing} while the rollout engine's {asleep} sleep; call wake({tuple(asleep)}) first")

    def _release(self, *, full_sync_next: bool) -> tuple[str, ...]:
        """Free what this backend can; returns the MEMORY_TAGS freed (default: nothing). A backend that
        drops the weights (allowed when `full_sync_next`) sets `_weights_missing`."""
        return ()

    def _reacquire(self, tags: tuple[str, ...]) -> None:
        """Give back `tags` (a subset of what `_release` freed)."""

    def shutdown(self) -> None:
        """Free the engine for good."""
