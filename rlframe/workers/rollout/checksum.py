"""Checksums of weight slices, for the invariant "after a weight sync the rollout engine holds exactly
the trainer's weights" (DESIGN.md section 11), checked slice by slice.

Both sides hash the same thing: for an HF parameter name and a Box of it (the slice a rollout rank
holds, in HF coordinates), sha256 of the slice's bytes (row-major) in the rollout's dtype.

- Rollout side (`RolloutEngine.weight_checksums`): the slice is read back from the engine's live
  tensors. vLLM keeps q/k/v fused in `qkv_proj` and gate/up in `gate_up_proj` per tp rank (this
  rank's slices concatenated on dim 0) and pads the vocabulary rows of embed_tokens/lm_head;
  `hf_slice_of_kernel_param` undoes both (the inverse of rollout/kernel_format.py). A tensor whose
  shape is not what that layout implies (a repacked or quantised layer) is reported as unverifiable,
  never guessed at.
- Trainer side (`trainer_slice_digests`): every requested parameter is gathered whole on one rank,
  one bucket of parameters at a time (the resharding planner, from the same HF-named shards a sync
  sends), cast to the rollout's dtype as the sync's copy into the rollout parameter casts (fp32 master
  weights -> bf16 rounds to nearest even, `Tensor.to`), and the requested boxes are hashed.

    digests = engine.weight_slice_digests()                      # [SliceDigest(name, box, dtype, digest)]
    trainer = trainer_slice_digests(train_engine, [(d.name, d.box, d.dtype) for d in digests], ...)
    mismatched = [d.key for d in digests if d.verifiable and trainer[d.key] != d.digest]
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from rlframe.resharding.box import Box
from rlframe.resharding.formats import FUSED_MODULES

UNVERIFIABLE = "unverifiable: "  # prefix of a digest that could not be computed, followed by why
VOCAB_PADDED = ("embed_tokens", "lm_head")  # modules whose vLLM rows are padded (weight_sync.VOCAB_PADDING)
DEFAULT_BUCKET_BYTES = 64 << 20


def slice_key(name: str, box: Box) -> str:
    """`model.layers.0.self_attn.q_proj.weight[0:32,0:64]`: a parameter's slice, as both sides name it."""
    return name + "[" + ",".join(f"{o}:{o + s}" for o, s in zip(box.offsets, box.sizes)) + "]"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 hex of `t`'s elements, row-major, in its own dtype (copied to CPU when needed)."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class SliceDigest:
    """The digest of one slice: sha256 hex, or `UNVERIFIABLE + why` when it could not be read back."""

    name: str
    box: Box
    dtype: str  # the rollout's dtype the bytes were hashed in ("" when unverifiable)
    digest: str

    @property
    def key(self) -> str:
        return slice_key(self.name, self.box)

    @property
    def verifiable(self) -> bool:
        return not self.digest.startswith(UNVERIFIABLE)


def digest_of(name: str, box: Box, read: torch.Tensor | str) -> SliceDigest:
    """A SliceDigest of the tensor `read` (the slice `box`), or an unverifiable one when `read` says why."""
    if isinstance(read, str):
        return SliceDigest(name, box, "", UNVERIFIABLE + read)
    if tuple(read.shape) != box.sizes:
        return SliceDigest(name, box, "", f"{UNVERIFIABLE}read back {tuple(read.shape)} for a {box.sizes} slice")
    return SliceDigest(name, box, dtype_name(read.dtype), tensor_digest(read))


# ---------------------------------------------------------------- rollout side: vLLM's kernel layout
def fused_name(name: str) -> tuple[str, tuple[str, ...], int] | None:
    """(vLLM name, HF names of its parts in order, position of `name`) for a fused part, else None."""
    for fused, parts in FUSED_MODULES.items():
        for i, part in enumerate(parts):
            tag = f".{part}."
            if tag in name:
                return name.replace(tag, f".{fused}."), tuple(name.replace(tag, f".{p}.") for p in parts), i
    return None


def kernel_name(name: str) -> str:
    """The vLLM parameter that holds HF parameter `name` (itself unless fused)."""
    fused = fused_name(name)
    return name if fused is None else fused[0]


def unfuse(fused: torch.Tensor, sizes: Iterable[int]) -> list[torch.Tensor]:
    """Split a fused kernel tensor into its parts along dim 0 (views); the sizes must add up."""
    sizes = [int(s) for s in sizes]
    if fused.dim() == 0 or sum(sizes) != fused.shape[0]:
        raise ValueError(f"cannot split a {tuple(fused.shape)} tensor into dim-0 parts of {sizes}: they do "
                         "not add up to its rows")
    return list(torch.split(fused, sizes, dim=0))


def hf_slice_of_kernel_param(name: str, needed: Mapping[str, Box], param: torch.Tensor) -> torch.Tensor | str:
    """This rank's slice `needed[name]` of HF parameter `name` as a view of vLLM's kernel tensor
    `param` (`qkv_proj` / `gate_up_proj` un-fused by the parts' row counts, vocabulary padding
    dropped), or a sentence saying why it cannot be read back."""
    held = needed[name].sizes
    fused = fused_name(name)
    if fused is not None:
        _, parts, pos = fused
        missing = [p for p in parts if p not in needed]
        if missing:
            return f"{kernel_name(name)} fuses {list(parts)} but this rank has no box of {missing}"
        sizes = [needed[p].sizes[0] for p in parts]
        if param.dim() != len(held) or tuple(param.shape[1:]) != held[1:] or param.shape[0] != sum(sizes):
            return (f"{kernel_name(name)} is {tuple(param.shape)}, not the {sizes} rows x {held[1:]} of its parts' "
                    "slices (a repacked layer?)")
        return unfuse(param, sizes)[pos]
    if tuple(param.shape) == held:
        return param
    padded = name.split(".")[-2] in VOCAB_PADDED and param.dim() == len(held) and param.shape[0] >= held[0]
    if padded and tuple(param.shape[1:]) == held[1:]:
        return param[: held[0]]  # the vocabulary rows this rank holds, padding rows dropped
    return f"the rollout tensor is {tuple(param.shape)}, this rank's slice is {held} (a repacked layer?)"


def within(name: str, held: Box, want: Box) -> Box | str:
    """`want` (global coordinates) relative to the held slice, or why it is not inside it."""
    if len(want.sizes) != len(held.sizes) or not held.contains(want):
        return f"this rank holds {slice_key(name, held)}, which does not contain the requested slice"
    return want.relative_to(held)


def slice_digests(read: Mapping[str, tuple[Box, torch.Tensor | str]], boxes: Mapping[str, Box] | None = None
                  ) -> list[SliceDigest]:
    """Digests of `boxes` ({name: global Box}; default: every held slice) from `read`, {name: (held
    Box, the held slice's tensor or why it cannot be read)}."""
    wanted = {n: b for n, (b, _) in read.items()} if boxes is None else dict(boxes)
    out = []
    for name, want in wanted.items():
        if want.empty:
            continue
        if name not in read:
            out.append(digest_of(name, want, "the rollout engine has no such parameter"))
            continue
        held, t = read[name]
        rel = within(name, held, want) if not isinstance(t, str) else t
        out.append(digest_of(name, want, rel if isinstance(rel, str) else t[rel.slices()]))
    return out


# ---------------------------------------------------------------- trainer side
def trainer_slice_digests(engine, requests: Iterable[tuple[str, Box, str]], *, num_layers: int | None,
                          bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, str] | None:
    """sha256 of each requested slice (name, Box, rollout dtype name) of the engine's current weights,
    {slice_key: digest}, on the engine's first rank (None on the others).

    Collective: every rank of the engine's layout calls it with the same requests. Whole parameters
    are gathered on the first rank by the resharding planner from `engine.local_shards()` (HF names
    and layout, what a sync sends), in buckets of `bucket_bytes`; num_layers: the model's (pp > 1).
    """
    from rlframe.resharding.executor import ShardAssembler, execute_plan
    from rlframe.resharding.layout import Layout
    from rlframe.resharding.planner import plan_reshard

    by_name: dict[str, list[tuple[Box, str]]] = {}
    for name, box, dtype in requests:
        by_name.setdefault(name, []).append((box, dtype))
    metas = engine.param_metas()
    src = engine.resharding_layout()
    root = min(src.ranks)
    plan = plan_reshard({n: metas[n] for n in sorted(by_name) if n in metas}, src=src,
                        dst=Layout(ranks=(root,)), num_layers=num_layers)
    out: dict[str, str] = {}

    def hash_complete(done):
        for name, _, full in done:
            for box, dtype in by_name[name]:
                out[slice_key(name, box)] = _trainer_digest(name, full, box, dtype)

    shards = {n: t for n, (_, _, t) in engine.local_shards().items() if n in plan.params}
    targets = {n: b for (n, r), b in plan.dst_boxes.items() if r == root}
    execute_plan(plan, local=shards, consumer=ShardAssembler(targets, hash_complete), bucket_bytes=bucket_bytes,
                 device=getattr(engine, "device", None))
    import torch.distributed as dist

    if dist.get_rank() != root:
        return None
    for name, wanted in by_name.items():
        for box, _ in wanted:
            out.setdefault(slice_key(name, box), f"{UNVERIFIABLE}the trainer has no parameter {name}")
    return out


def _trainer_digest(name: str, full: torch.Tensor, box: Box, dtype: str) -> str:
    if len(box.sizes) != full.dim() or not Box.full(full.shape).contains(box):
        return f"{UNVERIFIABLE}{slice_key(name, box)} is outside the trainer's {tuple(full.shape)} tensor"
    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype):
        return f"{UNVERIFIABLE}unknown rollout dtype {dtype!r}"
    return tensor_digest(full[box.slices()].to(target))
