import torch

from rlframe.utils.memory import peak_rss_mb, state_mb


def test_state_counts_params_grad_buffers_and_adam_moments_once():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    frozen = torch.nn.Linear(16, 16).requires_grad_(False)
    both = torch.nn.ModuleList([model, frozen])
    opt = torch.optim.AdamW([p for p in both.parameters() if p.requires_grad])
    both[0](torch.randn(2, 64)).sum().backward()
    opt.step()
    mb = 2**20
    trainable = sum(p.numel() for p in both.parameters() if p.requires_grad) * 4
    every = sum(p.numel() for p in both.parameters()) * 4
    got = state_mb(both, opt)
    assert got["params_mb"] == every / mb
    assert got["grads_mb"] == trainable / mb
    assert got["optimizer_mb"] == 2 * trainable / mb  # exp_avg and exp_avg_sq; the step counters are scalars
    assert got["state_mb"] == (every + 3 * trainable) / mb
    # a frozen model (no optimizer) allocates no gradients; a list of modules (megatron's chunks) is summed
    assert state_mb([frozen], None) == {"params_mb": 16 * 17 * 4 / mb, "grads_mb": 0.0, "optimizer_mb": 0.0,
                                        "state_mb": 16 * 17 * 4 / mb}
    # tensors sharing one storage count once
    tied = torch.nn.Linear(8, 8)
    shared = torch.nn.ModuleList([tied, tied])
    assert state_mb(shared, None)["params_mb"] == 8 * 9 * 4 / mb


def test_peak_rss_rises_with_touched_memory():
    before = peak_rss_mb()
    block = torch.ones(int(before + 64) * 2**20 // 4)  # larger than the whole process's old peak, written
    assert peak_rss_mb() >= before + 48
    del block
