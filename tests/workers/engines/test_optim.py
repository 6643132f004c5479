"""LR schedule shapes (single process) and LocalShardAdamW against torch.optim.AdamW on DTensors (2 gloo ranks)."""

import math

import pytest

from rlframe.workers.engines.optim import lr_lambda


def test_constant_with_warmup():
    f = [lr_lambda(s, schedule="constant", warmup_steps=4, total_steps=0, min_lr_ratio=0.0) for s in range(6)]
    assert f == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_warmup_then_decay_to_floor():
    kw = dict(schedule="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert lr_lambda(0, **kw) == 0.5 and lr_lambda(1, **kw) == 1.0
    assert lr_lambda(2, **kw) == pytest.approx(1.0)
    assert lr_lambda(7, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_lambda(12, **kw) == pytest.approx(0.1) and lr_lambda(50, **kw) == pytest.approx(0.1)
    values = [lr_lambda(s, **kw) for s in range(2, 13)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def _adamw_twins(rank, world):
    """torch.optim.AdamW on DTensors vs LocalShardAdamW on copies: sharded, replicated and a
    partial-sum gradient (redistributed first), two param groups, three steps."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from rlframe.workers.engines.optim import LocalShardAdamW

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    specs = [((6, 4), [Shard(0)]), ((4, 6), [Shard(1)]), ((5,), [Replicate()]), ((3, 3), [Replicate()])]
    full = [torch.randn(shape, generator=g) for shape, _ in specs]

    def params():
        return [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, pl)) for t, (_, pl) in zip(full, specs)]

    twins = []
    for cls in (torch.optim.AdamW, LocalShardAdamW):
        ps = params()
        opt = cls([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}],
                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        twins.append((ps, opt))
    for step in range(3):
        grads = [torch.randn(shape, generator=g) for shape, _ in specs]
        for ps, opt in twins:
            for i, (p, (shape, pl)) in enumerate(zip(ps, specs)):
                if i == 3:  # a partial sum over the mesh: each rank holds its share of the gradient
                    p.grad = DTensor.from_local(grads[i] / world, mesh, [Partial()])
                else:
                    p.grad = distribute_tensor(grads[i], mesh, pl)
            opt.step()
            opt.zero_grad(set_to_none=True)
    (ref, ref_opt), (new, new_opt) = twins
    same_params = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ref, new))
    same_state = all(torch.equal(ref_opt.state[a][k].to_local() if isinstance(ref_opt.state[a][k], DTensor)
                                 else ref_opt.state[a][k],
                                 new_opt.state[b][k].to_local() if isinstance(new_opt.state[b][k], DTensor)
                                 else new_opt.state[b][k])
                     for a, b in zip(ref, new) for k in ("step", "exp_avg", "exp_avg_sq"))
    moved = min(float((a.to_local() - distribute_tensor(t, mesh, pl).to_local()).abs().max())
                for a, t, (_, pl) in zip(new, full, specs))
    return same_params, same_state, type(new_opt.state[new[0]]["exp_avg"]).__name__, moved


def test_local_shard_adamw_is_torch_adamw_bit_for_bit():
    from rlframe.utils.spawn import run_distributed

    for same_params, same_state, state_type, moved in run_distributed(_adamw_twins, world_size=2, timeout_s=120):
        assert same_params and same_state
        assert state_type == "DTensor"  # checkpoints see torch's own state layout
        assert moved > 0


def _norm_with_a_rank_without_grads(rank, world):
    import torch
    import torch.distributed as dist

    from rlframe.workers.engines.optim import global_grad_norm

    p = torch.nn.Parameter(torch.zeros(3))
    if rank == 0:
        p.grad = torch.tensor([3.0, 4.0, 0.0])
    norm = global_grad_norm([p], groups=(dist.group.WORLD,), num_ranks=world, device=torch.device("cpu"))
    return float(norm), str(norm.device)


def test_grad_norm_on_a_rank_without_grads_joins_the_all_reduce():
    from rlframe.utils.spawn import run_distributed

    # a plain (replicated) gradient counts 1/num_ranks per rank: 25 / 2 from rank 0, nothing from rank 1
    results = run_distributed(_norm_with_a_rank_without_grads, world_size=2, timeout_s=60)
    assert results == [(pytest.approx(math.sqrt(12.5)), "cpu")] * 2


def test_grad_norm_lives_on_the_engine_device_without_grads():
    """The zero a rank without gradients reduces is made on the engine's device (NCCL takes only
    CUDA tensors); "meta" stands in for it on CPU."""
    import torch

    from rlframe.workers.engines.optim import global_grad_norm

    frozen = torch.nn.Parameter(torch.zeros(3))
    assert global_grad_norm([frozen], groups=(), num_ranks=1, device=torch.device("meta")).device.type == "meta"
    assert global_grad_norm([], groups=(), num_ranks=1, device=torch.device("meta")).device.type == "meta"


@pytest.mark.gpu
def test_grad_norm_on_cuda_with_and_without_grads():
    import torch

    from rlframe.workers.engines.optim import global_grad_norm

    cuda = torch.device("cuda", torch.cuda.current_device())
    with_grad = torch.nn.Parameter(torch.zeros(2, device=cuda))
    with_grad.grad = torch.tensor([3.0, 4.0], device=cuda)
    assert global_grad_norm([torch.nn.Parameter(torch.zeros(2))], groups=(), num_ranks=1, device=cuda).device == cuda
    norm = global_grad_norm([with_grad], groups=(), num_ranks=1, device=cuda)
    assert norm.device == cuda and float(norm) == 5.0
