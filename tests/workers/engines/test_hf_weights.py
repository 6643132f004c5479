"""hf_weights.iter_slices: each rank's box of a checkpoint tensor, read without the whole tensor, from
safetensors and from a pickle .bin alike; an empty box (an FSDP shard past the end of a dim smaller
than dp, e.g. a critic's (1, H) score at dp 2) gives an empty tensor."""

import pytest
import torch

from rlframe.resharding.box import Box
from rlframe.workers.engines.hf_weights import iter_slices


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_boxes_are_read_from_either_format_and_an_empty_box_is_empty(fmt, tmp_path):
    tensors = {"score.weight": torch.arange(6.0).reshape(1, 6), "w": torch.arange(24.0).reshape(4, 6)}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(tmp_path / "model.safetensors"))
    else:
        torch.save(tensors, tmp_path / "pytorch_model.bin")
    boxes = {"score.weight": ((1, 6), Box((1, 0), (0, 6))),  # dp rank 1 of 2: nothing of dim 0
             "w": ((4, 6), Box((2, 3), (2, 3))), "absent": ((2,), Box((0,), (2,)))}
    got = dict(iter_slices(str(tmp_path), boxes))
    assert set(got) == {"score.weight", "w"}  # a name the checkpoint lacks is skipped
    assert got["score.weight"].shape == (0, 6)
    assert torch.equal(got["w"], tensors["w"][2:4, 3:6])
