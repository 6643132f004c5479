"""Reading a megatron engine's checkpoint without a process group (`rlframe export`, the spec's read_checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch

from rlframe.workers.engines.export_error import ExportError


def read_model(engine_dir: Path, layout: dict, hf_config) -> dict[str, torch.Tensor]:
    """Whole HF-named tensors from a megatron engine's per-(tp, pp) `model.pt` files: each file is
    unpacked to HF names (fused qkv and fc1 split) and copied into its box of the global tensor."""
    from rlframe.resharding.formats import ModelDims, megatron_to_hf
    from rlframe.resharding.layout import Layout
    from rlframe.workers.engines.dcp_reader import load_weights_only
    from rlframe.workers.engines.megatron.weights import hf_shapes

    tp, pp, head = int(layout["tp"]), int(layout.get("pp", 1)), layout.get("head", "lm")
    dims = ModelDims.from_hf_config(hf_config)
    grid = Layout(tp=tp, pp=pp, dp=1)
    shapes = hf_shapes(dims, head=head)
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            file = engine_dir / f"mp_{tp_rank:02d}_{pp_rank:03d}" / "model.pt"
            if not file.is_file():
                raise ExportError(f"{file} is missing: a megatron checkpoint of tp={tp} pp={pp} has one model.pt "
                                  "per (tp, pp)")
            meg = {k: v for k, v in load_weights_only(str(file), what=str(file), map_location="cpu").items()
                   if not k.endswith("_extra_state")}
            hf = megatron_to_hf(meg, dims=dims, tp=tp, pp=pp, pp_rank=pp_rank, head=head)
            rank = grid.rank_of(pp=pp_rank, tp=tp_rank)
            for name, t in hf.items():
                if name not in shapes:
                    raise ExportError(f"{file}: {name} is not a parameter of the model at model_path")
                box = grid.box(name, shapes[name], rank, num_layers=dims.num_layers)
                if box is None or tuple(t.shape) != tuple(box.sizes):
                    raise ExportError(f"{file}: {name} has shape {tuple(t.shape)}, the layout tp={tp} pp={pp} "
                                      f"of the model at model_path expects {None if box is None else box.sizes}")
                if name not in full:
                    full[name] = torch.empty(shapes[name], dtype=t.dtype)
                full[name][box.slices()] = t
                filled[name] = filled.get(name, 0) + t.numel()
    missing = sorted(n for n, s in shapes.items() if filled.get(n, 0) < torch.Size(s).numel())
    if missing:
        raise ExportError(f"{engine_dir}: the shards do not cover {missing[:5]} (of {len(missing)}) whole")
    return {n: full[n] for n in shapes}
