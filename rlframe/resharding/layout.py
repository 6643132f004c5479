"""Parallel layouts: which slice (Box) of every HF parameter each rank holds.

A `Layout` names the parallel dimensions (pp, tp, dp), the ranks that run it and the coordinates
(pp, tp, dp) of each of those ranks. The default rank order is Megatron's: tp fastest, then dp,
then pp, so rank = tp_rank + tp * (dp_rank + dp * pp_rank). Any other order (or an explicit list of
coordinates, as the HybridFlow generation layout needs) is allowed.

The slice a rank holds follows one rule shared by the training engine, the rollout engine and the
resharding planner (so they agree by construction):

- pipeline: stage s owns a contiguous range of decoder layers; the embedding lives on the first
  stage, the final norm and lm_head on the last (`param_stage`);
- tensor parallel (Megatron style, `hf_tp_split_dim`): q/k/v/gate/up projections (weights and biases)
  and the vocab-parallel embed_tokens/lm_head are split on dim 0; o_proj/down_proj weights on dim 1;
  norms and the biases of row-parallel layers are replicated; LoRA adapters follow their projection
  (lora_B of a column-parallel one split on dim 0, lora_A of a row-parallel one on dim 1, the other
  factor replicated);
- FSDP (`fsdp=True`): the dp ranks additionally split the rank's TP shard on dim 0 with torch.chunk
  semantics (FSDP2's `Shard(0)` of the local tensor). Without it dp ranks are replicas (Megatron DP).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product

from rlframe.resharding.box import Box, chunk_box

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DIM0 = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_DIM1 = ("o_proj", "down_proj")
_DIMS = ("tp", "dp", "pp")


@lru_cache(maxsize=65536)  # called per (parameter, rank) by planners of large clusters
def hf_tp_split_dim(name: str) -> int | None:
    """The dim a Megatron-style tensor-parallel layer splits HF parameter `name` on (None: replicated).

    Column-parallel (q/k/v/gate/up, weight and bias) and vocab-parallel (embed_tokens, lm_head)
    split dim 0 (output features / vocabulary); row-parallel (o_proj, down_proj) weights split dim 1
    (input features) while their biases are replicated, as are all norms.
    """
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if module in ("lora_A", "lora_B") and len(parts) >= 3:
        # LoRA adapters (engines/lora.py): B (out, r) of a column-parallel projection splits its
        # output dim, A (r, in) of a row-parallel one its input dim; the other factor is replicated.
        base = parts[-3]
        if module == "lora_B" and base in _DIM0:
            return 0
        if module == "lora_A" and base in _DIM1:
            return 1
        return None
    if module in _DIM0 or module in ("embed_tokens", "lm_head"):
        return 0
    if module in _DIM1:
        return 1 if leaf == "weight" else None
    return None


def layer_index(name: str) -> int | None:
    """Decoder layer number in an HF parameter name (`model.layers.3.mlp...` -> 3), else None."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def stage_layer_range(num_layers: int, *, pp: int, stage: int) -> range:
    """Decoder layers of pipeline stage `stage`: contiguous, as even as possible, early stages larger."""
    if num_layers < pp:
        raise ValueError(
            f"pp({pp}) stages need at least one decoder layer each but the model has {num_layers}; "
            "lower pp or use a deeper model"
        )
    base, extra = divmod(num_layers, pp)
    lo = stage * base + min(stage, extra)
    return range(lo, lo + base + (1 if stage < extra else 0))


@lru_cache(maxsize=65536)
def param_stage(name: str, *, num_layers: int, pp: int) -> int:
    """Pipeline stage that owns HF parameter `name` (embedding first, final norm + lm_head last)."""
    if pp == 1:
        return 0
    layer = layer_index(name)
    if layer is not None:
        if not 0 <= layer < num_layers:
            raise ValueError(f"{name!r} names layer {layer} but the model has num_layers={num_layers}")
        for s in range(pp):
            if layer in stage_layer_range(num_layers, pp=pp, stage=s):
                return s
    return 0 if "embed_tokens" in name else pp - 1


def _coords_in_order(tp: int, dp: int, pp: int, order: tuple[str, ...]) -> tuple[tuple[int, int, int], ...]:
    sizes = {"tp": tp, "dp": dp, "pp": pp}
    coords = []
    # itertools.product varies its last factor fastest, so iterate the order reversed.
    for digits in product(*(range(sizes[d]) for d in reversed(order))):
        c = dict(zip(reversed(order), digits))
        coords.append((c["pp"], c["tp"], c["dp"]))
    return tuple(coords)


@dataclass(frozen=True)
class Layout:
    """A validated parallel layout over `ranks` (default 0..size-1).

    `coords[i]` is the (pp, tp, dp) coordinate of global rank `ranks[i]`; when not given it follows
    `order` ("tp-dp-pp" = Megatron: tp fastest). `fsdp=True` makes dp shard dim 0 instead of replicate.

    >>> Layout(tp=2, dp=2).coords_of(3)
    (0, 1, 1)
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    fsdp: bool = False
    order: str = "tp-dp-pp"
    ranks: tuple[int, ...] | None = None
    coords: tuple[tuple[int, int, int], ...] | None = None
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        for dim in _DIMS:
            v = getattr(self, dim)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{dim} must be a positive integer, got {v!r}")
        size = self.pp * self.tp * self.dp
        order = tuple(self.order.split("-"))
        if sorted(order) != sorted(_DIMS):
            raise ValueError(f"order {self.order!r} must name tp, dp and pp once each, fastest first, e.g. 'tp-dp-pp'")
        ranks = tuple(range(size)) if self.ranks is None else tuple(int(r) for r in self.ranks)
        if len(ranks) != size or len(set(ranks)) != size or min(ranks) < 0:
            raise ValueError(
                f"pp({self.pp}) * tp({self.tp}) * dp({self.dp}) = {size} ranks are needed but ranks={ranks} "
                f"lists {len(set(ranks))} distinct ones; pass exactly {size} distinct non-negative ranks"
            )
        coords = _coords_in_order(self.tp, self.dp, self.pp, order) if self.coords is None else tuple(
            tuple(int(x) for x in c) for c in self.coords
        )
        expected = set(product(range(self.pp), range(self.tp), range(self.dp)))
        if len(coords) != size or set(coords) != expected:
            raise ValueError(
                f"coords must list every (pp, tp, dp) in range ({self.pp}, {self.tp}, {self.dp}) exactly once, "
                f"one per rank ({size}); got {len(coords)} entries covering {len(set(coords) & expected)} of them"
            )
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "coords", coords)
        object.__setattr__(self, "_index", {r: i for i, r in enumerate(ranks)})

    @property
    def size(self) -> int:
        return self.pp * self.tp * self.dp

    def check_world_size(self, world_size: int) -> None:
        """Raise when the layout does not fit `world_size` processes (arithmetic in the message)."""
        if self.ranks == tuple(range(self.size)) and self.size != world_size:
            raise ValueError(
                f"pp({self.pp}) * tp({self.tp}) * dp({self.dp}) = {self.size} != world size {world_size}; "
                "change the layout so the product equals the number of processes"
            )
        if max(self.ranks) >= world_size:
            raise ValueError(f"layout uses rank {max(self.ranks)} but the world size is {world_size}")

    def coords_of(self, rank: int) -> tuple[int, int, int] | None:
        """(pp, tp, dp) of global `rank`, or None when the rank is not part of this layout."""
        i = self._index.get(rank)
        return None if i is None else self.coords[i]

    def rank_of(self, *, pp: int = 0, tp: int = 0, dp: int = 0) -> int:
        return self.ranks[self.coords.index((pp, tp, dp))]

    def box(self, name: str, shape, rank: int, *, num_layers: int | None = None) -> Box | None:
        """The Box of parameter `name` (global `shape`) that `rank` holds; None if it holds none of it."""
        c = self.coords_of(rank)
        if c is None:
            return None
        pp_rank, tp_rank, dp_rank = c
        if self.pp > 1:
            if num_layers is None:
                raise ValueError(f"pp({self.pp}) > 1: pass num_layers so decoder layers can be assigned to stages")
            if param_stage(name, num_layers=num_layers, pp=self.pp) != pp_rank:
                return None
        shape = tuple(int(s) for s in shape)
        dim = hf_tp_split_dim(name)
        b = Box.full(shape) if dim is None or self.tp == 1 else chunk_box(shape, dim=dim, index=tp_rank, parts=self.tp)
        if self.fsdp and self.dp > 1 and len(shape) > 0:
            sub = chunk_box(b.sizes, dim=0, index=dp_rank, parts=self.dp)
            b = Box(tuple(o + so for o, so in zip(b.offsets, sub.offsets)), sub.sizes)
        return None if b.empty else b

    def describe(self) -> str:
        kind = "fsdp" if self.fsdp else "replicated"
        lo, hi = min(self.ranks), max(self.ranks)
        where = f"{lo}..{hi}" if hi - lo + 1 == self.size else str(list(self.ranks))
        return f"pp={self.pp} tp={self.tp} dp={self.dp} ({kind}) on ranks {where}"


def training_box(name: str, shape, layout: Layout, rank: int, *, num_layers: int | None = None) -> Box | None:
    """Box of `name` that training `rank` holds under `layout` (same rule the planner uses)."""
    return layout.box(name, shape, rank, num_layers=num_layers)


def hybridflow_generation_layout(train: Layout, *, tp: int, pp: int = 1) -> Layout:
    """HybridFlow's generation layout (p_g, t_g, d_g, d) for a training layout (p, t, d).

    d_g = p*t / (p_g*t_g) micro-DP replicas per training model-parallel group. Generation TP/PP groups
    are strided: training tp rank i lands in generation tp rank i // (t/t_g) (and likewise for pp), so
    each rank's training shard lies inside its generation shard; the d_g ranks that complete one
    generation shard (consecutive tp ranks in Megatron order) form a micro-DP group
    (HybridFlow, Sheng et al. 2024, section 5 and Table 2). Generation dp index = d_idx * d_g + micro.
    """
    if train.tp % tp or train.pp % pp:
        raise ValueError(
            f"HybridFlow needs the generation groups to nest in the training ones: tp {train.tp} % t_g {tp} = "
            f"{train.tp % tp}, pp {train.pp} % p_g {pp} = {train.pp % pp} must both be 0; "
            "use the general planner with Layout(tp=..., dp=...) for other pairs"
        )
    rt, rp = train.tp // tp, train.pp // pp
    d_g = rt * rp
    coords = []
    for p_i, t_i, d_i in train.coords:
        micro = t_i % rt + rt * (p_i % rp)
        coords.append((p_i // rp, t_i // rt, d_i * d_g + micro))
    return Layout(tp=tp, dp=train.dp * d_g, pp=pp, ranks=train.ranks, coords=tuple(coords))


def generation_layout(train: Layout, *, tp: int) -> tuple[Layout, str]:
    """The generation layout the actor reshards into, and the scheme's name (the runtime and the
    dry run both call this: one source of truth).

    vLLM builds its tp groups from consecutive ranks (rank // tp). A megatron (non-fsdp) training
    layout uses HybridFlow's layout whenever its generation tp groups are exactly those, which holds
    when t/t_g = 1 or t_g = 1 (the CPU default): each rank's training shard then lies inside its
    generation shard and the bytes it receives are the minimum. Otherwise (fsdp, or strided groups
    vLLM would not build) the plain layout over consecutive ranks, with the general planner.
    """
    world = train.size
    if world % tp:
        raise ValueError(f"rollout tp {tp} must divide the actor's {world} processes")
    if not train.fsdp and train.tp % tp == 0:
        hybrid = hybridflow_generation_layout(train, tp=tp, pp=1)
        if _consecutive_tp_groups(hybrid):
            return hybrid, "HybridFlow (micro-DP groups)"
    return Layout(tp=tp, dp=world // tp, ranks=train.ranks), "general planner (box intersection)"


def _consecutive_tp_groups(layout: Layout) -> bool:
    """Every tp group is a run of `tp` consecutive ranks in tp order (how vLLM groups ranks)."""
    groups: dict[tuple[int, int], dict[int, int]] = {}
    for rank, (p, t, d) in zip(layout.ranks, layout.coords):
        groups.setdefault((p, d), {})[t] = rank
    return all(
        g[0] % layout.tp == 0 and [g[t] for t in range(layout.tp)] == list(range(g[0], g[0] + layout.tp))
        for g in groups.values()
    )
