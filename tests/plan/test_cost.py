"""The cost model's pieces against hand computations, and the calibration's fit recovering known
constants from step times the model itself produced."""

import dataclasses
import math

import pytest

from rlframe.config import load_config
from rlframe.plan.dry_run import model_dims
from rlframe.plan.calibrate import FITTED, TENSOR_PARALLEL, fit, tensor_parallel_variant
from rlframe.plan.cost import Constants, CostModel, estimate, flops_per_token, matmul_params, ring_seconds

# no fixed costs, no links: what remains is compute, which the hand computations below follow
PURE = Constants(flops=1e9, cores=2, train_eff=1.0, infer_eff=1.0, decode_eff=1.0, call_s=0.0, micro_s=0.0,
                 decode_s=0.0, latency_s=0.0, bandwidth=math.inf, net_latency_s=0.0, net_bandwidth=math.inf)


def cfg_of(name="ppo_tiny", *overrides):
    return load_config(name, [*overrides, "trainer.dry_run=true"])


def test_flops_by_hand():
    dims = model_dims(cfg_of())  # demo: 4 layers, hidden 128, 4 heads / 2 kv (head 32), mlp 384, vocab 100
    H, kv, I, L, V = 128, 2 * 32, 384, 4, 100
    per_layer = H * H + 2 * H * kv + H * H + 3 * H * I  # q, k, v, o, gate/up/down
    assert matmul_params(dims) == L * per_layer + H * V
    assert matmul_params(dims, head="value") == L * per_layer + H
    assert flops_per_token(dims, context=10) == 2 * (L * per_layer + H * V) + 4 * L * H * 10


def test_ring_collectives_by_hand():
    assert ring_seconds(1e6, 1, latency=1.0, bandwidth=1.0) == 0.0
    # 4 ranks all-reduce: 2 x 3 hops, each moving a quarter of the bytes
    assert ring_seconds(4e6, 4, latency=1e-3, bandwidth=1e9) == pytest.approx(6e-3 + 6 / 4 * 4e6 / 1e9)
    assert ring_seconds(4e6, 4, latency=1e-3, bandwidth=1e9, kind="all_gather") == pytest.approx(3e-3 + 3 / 4 * 4e6 / 1e9)


def test_one_training_pass_by_hand():
    cfg = cfg_of("ppo_tiny", "actor.micro_batch_size=16")  # dp 2, 128 samples of 16 + 8 tokens
    dims = model_dims(cfg)
    model = CostModel(cfg, dims, PURE)
    seq = 16 + 8
    flops = 3 * flops_per_token(dims, context=seq / 2) * 128 * seq / 2  # per rank: half the samples
    assert model._pass(cfg.actor, head="lm", train=True) == pytest.approx(flops / 1e9)
    fixed = CostModel(cfg, dims, dataclasses.replace(PURE, call_s=0.5, micro_s=0.25))
    # 64 rows per rank in micro-batches of 16: 4 of them
    assert fixed._pass(cfg.actor, head="lm", train=True) == pytest.approx(flops / 1e9 + 0.5 + 4 * 0.25)


def test_pipeline_bubble_and_tensor_split_by_hand():
    dims = model_dims(cfg_of())
    dp2 = CostModel(cfg_of("ppo_tiny", "actor.strategy=megatron", "critic.strategy=megatron"), dims, PURE)
    pp2 = cfg_of("ppo_tiny", "actor.strategy=megatron", "actor.dp=1", "actor.pp=2", "actor.micro_batch_size=32",
                 "critic.strategy=megatron", "critic.dp=1", "critic.pp=2", "critic.micro_batch_size=32")
    # the same work per rank (128 x 1 / 2 layers vs 64 rows x all layers), times 1 + (pp - 1) / 4 micro-batches
    assert CostModel(pp2, dims, PURE)._pass(pp2.actor, head="lm", train=True) == pytest.approx(
        dp2._pass(dp2.cfg.actor, head="lm", train=True) * (1 + 1 / 4))


def test_sharing_the_cores():
    """4 colocated processes on 2 cores compute at half speed; 2 do not slow down."""
    two = cfg_of("ppo_tiny")
    four = cfg_of("ppo_tiny", "resources.procs_per_node=4", "actor.dp=4", "critic.dp=4", "actor.micro_batch_size=32",
                  "critic.micro_batch_size=32")
    dims = model_dims(two)
    a, b = estimate(two, dims, PURE), estimate(four, dims, PURE)
    # dp 4 halves each rank's work, the cores' sharing doubles its time: the same update time
    assert b.phases["update_actor"] == pytest.approx(a.phases["update_actor"])


def test_asynchronous_overlap():
    """k >= 1: the step is the longer of generation and training, or the cores' total work."""
    split = ["resources.placement=split", "+resources.split_procs={actor: 1, critic: 1, ref: 1, rollout: 1}",
             "actor.dp=1", "critic.dp=1", "resources.procs_per_node=4", "algorithm.off_policy_correction=tis"]
    dims = model_dims(cfg_of())
    sync = estimate(cfg_of("ppo_tiny", *split), dims, PURE)
    ahead = estimate(cfg_of("ppo_tiny", *split, "trainer.max_staleness=1"), dims, PURE)
    gen = sync.phases["gen"]
    train = sync.total - gen - sync.phases["update_weights"]
    assert ahead.total < sync.total
    assert ahead.total >= max(gen, train) + ahead.phases["update_weights"] - 1e-12


def test_the_fit_recovers_the_constants():
    """Phase times made by the model with known constants: the fit finds those constants."""
    truth = dataclasses.replace(PURE, flops=50e9, train_eff=0.25, infer_eff=0.4, decode_eff=0.02, call_s=0.03,
                                micro_s=0.004, decode_s=0.003, latency_s=1e-4, bandwidth=1e9, tp_call_s=2e-3)
    samples = []
    for overrides in ([], ["actor.micro_batch_size=8", "critic.micro_batch_size=8"], ["data.train_batch_size=256"],
                      ["resources.procs_per_node=4", "actor.dp=4", "critic.dp=4"],
                      tensor_parallel_variant(cfg_of("ppo_tiny"))):
        cfg = cfg_of("ppo_tiny", *overrides)
        samples.append((cfg, estimate(cfg, model_dims(cfg), truth).phases))
    assert samples[-1][0].actor.tp == samples[-1][0].critic.tp == 2
    start = dataclasses.replace(truth, **{k: 1.0 for k in (*FITTED, TENSOR_PARALLEL)})
    fitted, err = fit(samples, model_dims(samples[0][0]), start)
    assert err < 1e-6
    for k in (*FITTED, TENSOR_PARALLEL):
        assert getattr(fitted, k) == pytest.approx(getattr(truth, k), rel=1e-6), k
    # without a tensor-parallel profile tp_call_s is not fitted: it keeps its given value
    fitted, _ = fit(samples[:-1], model_dims(samples[0][0]), start)
    assert fitted.tp_call_s == 1.0


def test_nnls_against_brute_force():
    """Lawson-Hanson equals the best of every sign pattern's unconstrained solution."""
    import itertools

    import numpy as np

    from rlframe.plan.calibrate import nnls

    rng = np.random.default_rng(0)
    for _ in range(20):
        a, y = rng.normal(size=(12, 5)), rng.normal(size=12)
        best = np.inf
        for keep in itertools.product([0, 1], repeat=5):
            cols = [i for i in range(5) if keep[i]]
            x = np.zeros(5)
            if cols:
                x[cols] = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
            if (x >= 0).all():
                best = min(best, np.linalg.norm(a @ x - y))
        x = nnls(a, y)
        assert (x >= 0).all()
        assert np.linalg.norm(a @ x - y) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_lora_with_kl_runs_its_reference_pass_on_the_actor():
    cfg = cfg_of("grpo_tiny", "actor.lora_rank=4", "resources.procs_per_node=2")
    assert cfg.uses_ref
    assert "ref" in estimate(cfg, model_dims(cfg), PURE).phases


def test_remax_generates_twice():
    plain, remax = cfg_of("ppo_tiny"), cfg_of("ppo_tiny", "algorithm=remax")
    dims = model_dims(plain)
    model = CostModel(plain, dims, PURE)
    assert estimate(remax, dims, PURE).phases["gen"] == pytest.approx(
        model.generate() + model.generate(plain.data.train_batch_size))


def test_weight_sync_by_hand():
    """Colocated fsdp dp2 into two vLLM replicas: each rank receives the half of every tensor it does
    not hold (the planner's bytes), in one bucket: one latency."""
    cfg = cfg_of("ppo_tiny")
    dims = model_dims(cfg)
    from rlframe.resharding.formats import hf_param_shapes
    from math import prod

    total = sum(prod(s) for s in hf_param_shapes(dims).values()) * 4
    c = dataclasses.replace(PURE, latency_s=0.01, bandwidth=1e6)
    sync = CostModel(cfg, dims, c).weight_sync()
    assert sync == pytest.approx(0.01 + total / 2 / 1e6, rel=0.02)  # dim-0 shards: about half of each tensor
