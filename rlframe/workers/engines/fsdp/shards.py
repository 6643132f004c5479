"""What each rank holds of each parameter, as a Box of the global tensor (for resharding).

A parameter is a DTensor on the (dp, tp) mesh or on the dp mesh alone. Its placements say how it
was split: e.g. a column-parallel weight is (_StridedShard(0, split_factor=tp), Shard(0)) after
FSDP2 sharded dim 0 of each tp slice. The box offset comes from DTensor's own
`compute_local_shape_and_global_offset`; we additionally follow the global index of every row and
column through the placements to check the local tensor really is one contiguous box (a strided
shard whose rows interleave would not be, and the resharding planner could not describe it).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from rlframe.resharding.box import Box


def _dim_indices(global_shape, mesh, placements) -> list[torch.Tensor]:
    """Per tensor dim, the global indices this rank holds (in local order)."""
    coord = mesh.get_coordinate()
    idx = [torch.arange(n) for n in global_shape]
    for mesh_dim, pl in enumerate(placements):
        if isinstance(pl, (Shard, _StridedShard)):  # DTensor's own split, of a 1-D index tensor
            along = _StridedShard(0, split_factor=pl.split_factor) if isinstance(pl, _StridedShard) else Shard(0)
            pieces, _ = along._split_tensor(idx[pl.dim], mesh.size(mesh_dim), with_padding=False)
            idx[pl.dim] = pieces[coord[mesh_dim]]
    return idx


# (global shape, placements, mesh shape, this rank's mesh coordinate) -> Box, which those determine:
# computing and checking a box was most of `local_shards`, which runs at every weight sync.
_boxes: dict[tuple, Box] = {}


def dtensor_box(t: DTensor, *, name: str = "") -> Box:
    """The Box of `t`'s global tensor that this rank's local tensor covers (asserted contiguous)."""
    shape = tuple(t.shape)
    mesh = t.device_mesh
    key = (shape, tuple(t.placements), tuple(mesh.shape), tuple(mesh.get_coordinate() or ()))
    box = _boxes.get(key)
    if box is None:
        box = _boxes[key] = _checked_box(t, shape, name)
    assert tuple(t.to_local().shape) == box.sizes, (name, t.to_local().shape, box)
    return box


def _checked_box(t: DTensor, shape: tuple[int, ...], name: str) -> Box:
    local_shape, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
    box = Box(tuple(int(o) for o in offset), tuple(int(s) for s in local_shape))
    for d, ix in enumerate(_dim_indices(shape, t.device_mesh, t.placements)):
        if box.sizes[d] == 0:
            continue
        expect = torch.arange(box.offsets[d], box.offsets[d] + box.sizes[d])
        assert torch.equal(ix, expect), f"{name}: local shard is not a contiguous box along dim {d} ({t.placements})"
    return box


def local_shards(model) -> dict[str, tuple[tuple[int, ...], Box, torch.Tensor]]:
    """HF parameter name -> (global shape, Box held here, local tensor sharing storage)."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = (tuple(p.shape), dtensor_box(p, name=name), p.detach().to_local())
        else:
            out[name] = (tuple(p.shape), Box.full(p.shape), p.detach())
    return out
