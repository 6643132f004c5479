"""Property: however a mini-batch is split into micro-batches and dp ranks (uneven shards, token
budgets, empty responses), the sum of the per-micro-batch losses that the engine's "global"
weighting gives equals the loss of the whole mini-batch computed at once, and so do its gradient and
its metrics: policy loss in every loss mode, the entropy bonus, the KL loss and the value loss."""

import random

import pytest
import torch

from rlframe.algos import LOSS_AGG_MODES
from rlframe.config.schema import AlgorithmConfig
from rlframe.workers.engines.accumulate import attach_global_counts
from rlframe.workers.engines.micro_batch import MicroBatch
from rlframe.workers.losses import actor_loss_fn, critic_loss_fn

R = 7


def _batch(rng: random.Random, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    lengths = torch.tensor([0 if rng.random() < 0.2 else rng.randint(1, R) for _ in range(rows)])
    lengths[0] = R  # at least one token in the batch
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    return {"response_mask": mask, "old_log_probs": -torch.rand(rows, R, generator=g) * 3,
            "ref_log_prob": -torch.rand(rows, R, generator=g) * 3, "advantages": torch.randn(rows, R, generator=g),
            "values": torch.randn(rows, R, generator=g), "returns": torch.randn(rows, R, generator=g),
            "rollout_log_probs": -torch.rand(rows, R, generator=g) * 3}


def _split(rng: random.Random, rows: int) -> list[list[list[int]]]:
    """Rows shuffled into 1-3 uneven dp shards, each cut into micro-batches of random sizes."""
    order = list(range(rows))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, rows), rng.randint(0, min(2, rows - 1))))
    return [_micro_batches(rng, order[a:b]) for a, b in zip([0] + cuts, cuts + [rows])]


def _micro_batches(rng: random.Random, shard: list[int]) -> list[list[int]]:
    """`shard` cut into consecutive micro-batches of random sizes."""
    mbs, i = [], 0
    while i < len(shard):
        k = rng.randint(1, len(shard) - i)
        mbs.append(shard[i:i + k])
        i += k
    return mbs


def _outputs(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"log_probs": (-torch.rand(rows, R, generator=g) * 3).requires_grad_(),
            "entropy": (torch.rand(rows, R, generator=g) * 2).requires_grad_(),
            "values": torch.randn(rows, R, generator=g).requires_grad_()}


def _whole_and_split(loss_fn, batch, split, seed):
    rows = batch["response_mask"].shape[0]
    whole_out = _outputs(rows, seed)
    whole, whole_m = loss_fn(whole_out, batch)
    whole.backward()
    parts = _outputs(rows, seed)
    mbs = [MicroBatch({k: v[idx] for k, v in batch.items()}, torch.tensor(idx)) for shard in split for idx in shard]
    attach_global_counts(mbs, dp=1, dp_group=None, device=torch.device("cpu"))  # = the all-reduce over shards
    total, metrics = 0.0, {}
    for mb in mbs:
        loss, m = loss_fn({k: v[mb.index] for k, v in parts.items()}, mb.data)
        total = total + loss
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    total.backward()
    return (whole, whole_out, whole_m), (total, parts, metrics)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES.names()))
def test_actor_loss_and_gradient_do_not_depend_on_the_split(mode, seed):
    rng = random.Random(seed)
    batch = _batch(rng, rows=rng.randint(2, 12))
    algo = AlgorithmConfig(loss_agg_mode=mode, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                           loss_scale_factor=float(R))
    for on_policy in (False, True):
        (whole, wo, wm), (total, po, pm) = _whole_and_split(actor_loss_fn(algo, on_policy=on_policy), batch,
                                                            _split(rng, len(batch["response_mask"])), seed)
        assert torch.allclose(whole, total, atol=1e-5), (mode, float(whole), float(total))
        for key in ("log_probs", "entropy"):
            assert torch.allclose(wo[key].grad, po[key].grad, atol=1e-6), (mode, key)
        for k, v in wm.items():
            assert abs(float(v) - pm[k]) < 1e-5, (mode, k, float(v), pm[k])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", sorted(LOSS_AGG_MODES.names()))
def test_value_loss_and_gradient_do_not_depend_on_the_split(mode, seed):
    rng = random.Random(100 + seed)
    batch = _batch(rng, rows=rng.randint(2, 12))
    (whole, wo, wm), (total, po, pm) = _whole_and_split(critic_loss_fn(cliprange_value=0.2, loss_agg_mode=mode),
                                                        batch, _split(rng, len(batch["response_mask"])), seed)
    assert torch.allclose(whole, total, atol=1e-5)
    assert torch.allclose(wo["values"].grad, po["values"].grad, atol=1e-6)
    for k, v in wm.items():
        assert abs(float(v) - pm[k]) < 1e-5, (mode, k)


# ---- the same property under real data parallelism ------------------------------------------------
def _dp_split(rng: random.Random, rows: int, world: int) -> list[list[list[int]]]:
    """Rows shuffled into exactly `world` uneven, non-empty dp shards, each cut into micro-batches."""
    order = list(range(rows))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, rows), world - 1))
    return [_micro_batches(rng, order[a:b]) for a, b in zip([0] + cuts, cuts + [rows])]


def _rank_errors(rank: int, world: int, seeds) -> dict[str, float]:
    """On each gloo rank: its shard's micro-batches, each cut to its own padded width (its longest
    response), weighted by the engine's "global" weighting (counts all-reduced over dp), backward,
    then the gradient averaged over the ranks as the engines do; against the whole mini-batch at once."""
    import torch.distributed as dist

    from rlframe.workers.engines.accumulate import micro_batch_weights

    errors: dict[str, float] = {}
    for mode in sorted(LOSS_AGG_MODES.names()):
        for seed in seeds:
            rng = random.Random(1000 + seed)  # the same batch and split on every rank
            rows = rng.randint(world + 2, 12)
            batch = _batch(rng, rows)
            shards = _dp_split(rng, rows, world)
            algo = AlgorithmConfig(loss_agg_mode=mode, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                                   loss_scale_factor=float(R))
            cases = (("actor", actor_loss_fn(algo), ("log_probs", "entropy")),
                     ("actor_on_policy", actor_loss_fn(algo, on_policy=True), ("log_probs", "entropy")),
                     ("critic", critic_loss_fn(cliprange_value=0.2, loss_agg_mode=mode, loss_scale_factor=float(R)),
                      ("values",)))
            for name, loss_fn, grads in cases:
                tag = f"{mode}/{seed}/{name}"
                whole_out = _outputs(rows, seed)
                whole, whole_m = loss_fn(whole_out, batch)
                whole.backward()
                parts = _outputs(rows, seed)
                mbs = []
                for idx in shards[rank]:
                    width = max(1, int(batch["response_mask"][idx].sum(-1).max()))
                    mbs.append(MicroBatch({k: v[idx][:, :width] for k, v in batch.items()}, torch.tensor(idx)))
                weights = micro_batch_weights(mbs, "global", dp=world, dp_group=None, device=torch.device("cpu"))
                sums = torch.zeros(1 + len(whole_m), dtype=torch.float64)
                for mb, w in zip(mbs, weights):
                    width = mb.data["response_mask"].shape[1]
                    loss, m = loss_fn({k: v[mb.index][:, :width] for k, v in parts.items()}, mb.data)
                    (loss * w).backward()
                    sums += torch.tensor([float(loss)] + [float(m[k]) for k in whole_m], dtype=torch.float64) * w
                dist.all_reduce(sums)  # the step's reported loss and metrics: weighted sums / dp, over dp
                sums /= world
                errors[f"{tag}/loss"] = abs(float(sums[0]) - float(whole))
                for i, k in enumerate(whole_m, start=1):
                    errors[f"{tag}/{k}"] = abs(float(sums[i]) - float(whole_m[k]))
                for key in grads:  # the engines' dp average of the gradients (FSDP's reduce-scatter, DDP's all-reduce)
                    g = parts[key].grad.clone()
                    dist.all_reduce(g)
                    errors[f"{tag}/grad/{key}"] = float((g / world - whole_out[key].grad).abs().max())
    return errors


def test_losses_under_two_data_parallel_ranks_equal_the_whole_batch():
    """Two spawned gloo ranks with uneven shards and micro-batches of different padded widths: the
    all-reduced counts and the dp factor of the weights make the dp-averaged gradient, the loss and
    the metrics those of the whole mini-batch, in every loss mode, for the policy and the value loss."""
    from rlframe.utils.spawn import run_distributed

    for errors in run_distributed(_rank_errors, world_size=2, args=(range(4),)):
        bad = {k: v for k, v in errors.items() if not v < 1e-5}
        assert not bad, bad
