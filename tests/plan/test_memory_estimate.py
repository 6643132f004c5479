"""The memory estimate's device settings and constants (the arithmetic is in test_dry_run.py)."""

import pytest
import torch

from rlframe.plan.memory_estimate import CUDA_CONTEXT_AND_NCCL_GIB, H100_80GB_GIB, GiB, device_memory
from rlframe.utils.spawn import run_distributed


def test_device_memory_setting_wins_else_a_visible_gpu_else_an_h100():
    assert device_memory(40.0) == (40.0, "resources.device_memory_gib")
    gib, source = device_memory(None)
    if torch.cuda.is_available():
        assert gib == torch.cuda.mem_get_info()[1] / GiB and "this machine's" in source
    else:
        assert gib == H100_80GB_GIB and "H100 80GB" in source


@pytest.mark.gpu
def test_h100_default_is_what_torch_reports_on_an_h100():
    name, total = torch.cuda.get_device_name(), torch.cuda.mem_get_info()[1] / GiB
    if "H100 80GB HBM3" not in name:
        pytest.skip(f"not an H100 80GB SXM: {name}, {total:.2f} GiB")
    assert total == pytest.approx(H100_80GB_GIB, abs=0.01)


def _context_and_nccl_gib(rank, world):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)  # NCCL sets up its communicator and buffers at the first collective
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / GiB  # what the caching allocator does not hold


@pytest.mark.gpu
def test_cuda_context_and_nccl_constant_covers_a_measured_process():
    """A fresh process's CUDA context and one NCCL communicator (GPU memory used outside torch's
    allocator, on a device nothing else uses) stay below the constant, which also covers the
    further communicators of a real run."""
    used = run_distributed(_context_and_nccl_gib, world_size=1, backend="nccl")[0]
    print(f"CUDA context + one NCCL communicator: {used:.2f} GiB")
    assert 0 < used < CUDA_CONTEXT_AND_NCCL_GIB


def test_the_first_checkpoints_estimate_sizes_the_critic_from_its_own_model(tmp_path):
    """With model.critic_path the critic's share comes from the critic's config.json, not the actor's:
    a small critic beside the actor is not counted as a second actor (a first save that fits the disk
    must not be refused)."""
    import json

    from rlframe.config import load_config
    from rlframe.plan.memory_estimate import estimated_checkpoint_bytes

    same = estimated_checkpoint_bytes(load_config("ppo_tiny", []))
    small = tmp_path / "critic"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 32, "vocab_size": 64}))
    other = estimated_checkpoint_bytes(load_config("ppo_tiny", [f"model.critic_path={small}"]))
    assert other < same * 0.75, (other, same)  # the actor's share stays, the critic's shrinks to almost nothing
