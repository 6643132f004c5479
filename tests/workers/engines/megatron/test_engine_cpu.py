"""The megatron engine on CPU (gloo, real megatron-core modules, schedules, DDP and distributed
optimizer) equals the fsdp engine on one process, for every layout.

Same HF weights, same batch (mixed prompt/response lengths), fp32: log-probs and entropy (actor),
values (critic), the loss, the gradient norm and every weight after one optimizer step agree within
1e-5 for tp1, tp2, dp2, pp2, tp2 x pp2 (4 ranks) and tp2 with sequence parallelism. The megatron
engine computes each micro-batch at its longest sample's width, and more left padding changes none
of its outputs. Each rank of a
data-parallel layout gets its contiguous share of the batch, as the dispatcher gives it.

Adam's eps is raised to 1e-3 in both engines: with eps=1e-8 the first step is lr * sign(g), so a
gradient of ~1e-9 that rounds differently in two backends moves a weight by 2 * lr; with a larger
eps the update is a smooth function of the gradient, and 1e-5 on the weights is a real bound.
"""

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from rlframe.utils.spawn import run_distributed  # noqa: E402
from tests.workers.engines.megatron.models import build_hf_model, build_hf_critic  # noqa: E402

TOL = 1e-5
# name: (tp, pp, world, sequence_parallel)
LAYOUTS = {"tp1": (1, 1, 1, False), "tp2": (2, 1, 2, False), "dp2": (1, 1, 2, False), "pp2": (1, 2, 2, False),
           "tp2xpp2": (2, 2, 4, False), "tp2-sp": (2, 1, 2, True)}
BATCH = 8


def _engine(backend, *, head, path, tp=1, pp=1, dp=1, sp=False, mixed_precision=False):
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    return get_train_engine(backend)(TrainEngineConfig(
        model_path=path, head=head, tp=tp, pp=pp, dp=dp, sequence_parallel=sp, lr=2e-3, eps=1e-3,
        grad_clip=None, micro_batch_size=2, mixed_precision=mixed_precision))


def _more_left_padding(batch, k):
    """The same samples with k more padding columns left of every prompt."""
    import torch

    pad = lambda t: torch.cat([t.new_zeros(t.shape[0], k), t], dim=1)  # noqa: E731
    return {**batch, **{key: pad(batch[key]) for key in ("input_ids", "attention_mask", "position_ids")}}


def _run_role(engine, head, batch):
    """Outputs before the step (also of the batch with more left padding), step metrics, outputs after,
    full weights (numpy; None off the output rank)."""
    from tests.workers.engines.reference import policy_loss, value_loss

    if head == "lm":
        forward = lambda b=batch: engine.forward_log_probs(b, with_entropy=True)  # noqa: E731
    else:
        forward = lambda b=batch: {"values": engine.forward_values(b)}  # noqa: E731
    before = forward()
    padded = forward(_more_left_padding(batch, 5))
    metrics = engine.train_step(policy_loss if head == "lm" else value_loss, batch, with_entropy=head == "lm")
    after = forward()
    full = engine.full_state_dict()
    as_np = lambda d: None if d is None or d.get("values", 0) is None else {k: v.numpy() for k, v in d.items()}  # noqa
    return {"before": as_np(before), "after": as_np(after), "padded": as_np(padded),
            "loss": metrics.get("loss"), "grad_norm": metrics["grad_norm"], "computed": metrics["tokens_computed"],
            "full": {k: v.numpy() for k, v in full.items()} if engine.is_first_rank else None}


def _both_roles(rank, world, backend, tp, pp, sp, lm_path, critic_path):
    from tests.workers.engines.reference import make_batch

    dp = world // (tp * pp)
    batch = make_batch(batch_size=BATCH, vocab=64, seed=3)
    out = {}
    for head, path in (("lm", lm_path), ("value", critic_path)):
        engine = _engine(backend, head=head, path=path, tp=tp, pp=pp, dp=dp, sp=sp)
        coords = engine.layout()
        share = BATCH // dp
        lo = coords["dp_rank"] * share
        out[head] = _run_role(engine, head, {k: v[lo:lo + share] for k, v in batch.items()})
        out[head]["coords"] = coords
    return out


def _gather_rows(results, head, key):
    """Per-token outputs of the output ranks (last pipeline stage, tp rank 0), in dp order."""
    rows = [(r[head]["coords"]["dp_rank"], r[head][key]) for r in results
            if r[head][key] is not None and r[head]["coords"]["tp_rank"] == 0]
    return {k: np.concatenate([d[k] for _, d in sorted(rows, key=lambda x: x[0])]) for k in rows[0][1]}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("meg_cpu")
    return build_hf_model(str(root / "lm"), "qwen2"), build_hf_critic(str(root / "critic"), "qwen2")


@pytest.fixture(scope="module")
def reference(paths):
    return run_distributed(_both_roles, world_size=1, args=("fsdp", 1, 1, False, *paths))[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_equals_fsdp(layout, paths, reference):
    from tests.workers.engines.reference import make_batch

    tp, pp, world, sp = LAYOUTS[layout]
    results = run_distributed(_both_roles, world_size=world, args=("megatron", tp, pp, sp, *paths), timeout_s=600)
    batch = make_batch(batch_size=BATCH, vocab=64, seed=3)
    mask = batch["response_mask"].numpy().astype(bool)
    # each micro-batch (2 rows) is computed at its longest sample's width (a multiple of tp under sp)
    longest = batch["attention_mask"].sum(1).view(-1, 2).max(1).values
    computed = int((2 * (longest + (-longest) % (tp if sp else 1))).sum())
    worst = {}
    for head in ("lm", "value"):
        ref = reference[head]
        meg = next(r[head] for r in results if r[head]["before"] is not None)  # a last-stage rank
        meg["full"] = results[0][head]["full"]
        assert meg["computed"] == computed < batch["input_ids"].numel(), (meg["computed"], computed)
        before = _gather_rows(results, head, "before")
        padded = _gather_rows(results, head, "padded")  # left padding changes nothing, bit for bit
        assert all(np.array_equal(padded[k], before[k]) for k in before), head
        for key in ("before", "after"):
            got = _gather_rows(results, head, key)
            for name, want in ref[key].items():
                worst[f"{head}/{key}/{name}"] = float(np.abs(got[name] - want)[mask].max())
        worst[f"{head}/loss"] = abs(meg["loss"] - ref["loss"])
        worst[f"{head}/grad_norm"] = abs(meg["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
        assert meg["full"].keys() == ref["full"].keys()
        worst[f"{head}/weights"] = max(float(np.abs(meg["full"][n] - ref["full"][n]).max()) for n in ref["full"])
    moved = max(float(np.abs(reference["lm"]["after"]["log_probs"] - reference["lm"]["before"]["log_probs"]).max()), 0)
    assert moved > 1e-2, "the step must change the model for the 'after' comparison to mean anything"
    print(f"\n{layout} worst: {max(worst.values()):.2e} {worst}")
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{layout}: {bad} (all: {worst})"


def _bf16_tp2(rank, world, lm_path):
    from tests.workers.engines.reference import make_batch, policy_loss

    engine = _engine("megatron", head="lm", path=lm_path, tp=2, mixed_precision=True)
    batch = make_batch(batch_size=BATCH, vocab=64, seed=3)
    before = engine.forward_log_probs(batch, with_entropy=True)
    losses = [engine.train_step(policy_loss, batch, with_entropy=True)["loss"] for _ in range(4)]
    from rlframe.utils.memory import state_mb

    return {"log_probs": before["log_probs"].numpy(), "dtype": str(before["log_probs"].dtype), "losses": losses,
            "params": sorted({str(p.dtype) for p in engine.model.parameters()}),
            "state": state_mb(engine.model, engine.optimizer), "numel": sum(p.numel() for p in engine.model.parameters())}


def _recompute_tp2(rank, world, lm_path):
    """One fp32 step at tp2 with activation_checkpointing off and on (megatron-core's full recompute,
    one layer per unit), counting the first layer's MLP forwards."""
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine
    from tests.workers.engines.reference import make_batch, policy_loss

    batch = make_batch(batch_size=4, vocab=64, seed=3)
    out = {}
    for on in (False, True):
        engine = get_train_engine("megatron")(TrainEngineConfig(
            model_path=lm_path, tp=2, lr=2e-3, eps=1e-3, grad_clip=None, activation_checkpointing=on))
        calls = []  # once per micro-batch, twice with recompute
        engine.model.module.decoder.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        before = engine.full_state_dict()
        metrics = engine.train_step(policy_loss, batch, with_entropy=True)
        after = engine.full_state_dict()
        out[on] = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "mlp_forwards": len(calls),
                   "after": after, "moved": max(float((after[k] - before[k]).abs().max()) for k in after)}
    from tests.workers.engines.reference import empty_minibatch_errors

    return {"empty": empty_minibatch_errors(engine, batch), "forwards": (out[False]["mlp_forwards"], out[True]["mlp_forwards"]),
            "loss": abs(out[True]["loss"] - out[False]["loss"]),
            "grad_norm": abs(out[True]["grad_norm"] - out[False]["grad_norm"]),
            "weights": max(float((out[True]["after"][k] - out[False]["after"][k]).abs().max()) for k in out[False]["after"]),
            "moved": out[False]["moved"]}


def _tp2_cases(rank, world, lm_path):
    return {"bf16": _bf16_tp2(rank, world, lm_path), "recompute": _recompute_tp2(rank, world, lm_path)}


@pytest.fixture(scope="module")
def tp2_cases(paths):
    """Both tp2 cases in one pair of processes (one megatron start-up for the two tests)."""
    return run_distributed(_tp2_cases, world_size=2, args=(paths[0],), timeout_s=600)


def test_megatron_bf16_on_cpu(tp2_cases, reference):
    """precision=bf16 (bf16 weights and compute, fp32 main weights in the distributed optimizer) at
    TP=2 on gloo: fp32 log-probs near the fp32 reference's, the same first loss up to bf16, and it learns."""
    from tests.workers.engines.reference import make_batch

    out = tp2_cases[0]["bf16"]
    mask = make_batch(batch_size=BATCH, vocab=64, seed=3)["response_mask"].numpy().astype(bool)
    assert out["params"] == ["torch.bfloat16"] and out["dtype"] == "torch.float32"
    diff = np.abs(out["log_probs"] - reference["lm"]["before"]["log_probs"])[mask]
    assert 0 < float(diff.mean()) < 0.05, float(diff.mean())
    assert out["losses"][0] == pytest.approx(reference["lm"]["loss"], rel=2e-2)
    assert out["losses"][-1] < out["losses"][0], out["losses"]
    # the state the memory metrics count (rlframe/utils/memory.py) through megatron's chained distributed
    # optimizer: bf16 weights, the fp32 gradient buffer, fp32 master weights and Adam's two fp32 moments
    # (dp=1: nothing sharded), each up to megatron's bucket padding
    mb = out["numel"] / 2**20
    for key, per_param in (("params_mb", 2), ("grads_mb", 4), ("optimizer_mb", 12)):
        assert per_param * mb <= out["state"][key] <= 1.1 * per_param * mb, (key, out["state"], mb)


def test_activation_checkpointing_gives_the_same_step(tp2_cases):
    """actor.activation_checkpointing on megatron: the backward recomputes every layer, and the step's
    loss, gradient norm and new weights equal those without it."""
    for res in (r["recompute"] for r in tp2_cases):
        off, on = res["forwards"]
        assert off >= 1 and on == 2 * off, res
        assert res["moved"] > 1e-4, res
        assert res["loss"] <= 1e-6 and res["grad_norm"] <= 1e-6 and res["weights"] <= 1e-6, res
        # a mini-batch an off-policy correction emptied: skipped on both tp ranks, nothing stepped
        assert all(v == 0.0 for v in res["empty"].values()), res["empty"]


def _train_save_or_resume(rank, world, lm_path, ckpt_dir, export_dir, resume):
    """dp2 x pp2: step 1 then save (and export), or load; then step 2. Returns step 2's metrics (last stage)."""
    import torch

    from tests.workers.engines.reference import make_batch, policy_loss

    engine = _engine("megatron", head="lm", path=lm_path, pp=2, dp=2)
    share = BATCH // 2
    lo = engine.layout()["dp_rank"] * share
    batch1, batch2 = ({k: v[lo:lo + share] for k, v in make_batch(batch_size=BATCH, vocab=64, seed=s).items()}
                      for s in (4, 5))
    exported = None
    if resume:
        engine.load_checkpoint(ckpt_dir)
    else:
        engine.train_step(policy_loss, batch1, with_entropy=True)
        engine.save_checkpoint(ckpt_dir)
        engine.export_hf(export_dir)
        out = engine.forward_log_probs(batch1)
        exported = None if out is None else out["log_probs"].numpy()
    rng = float(torch.rand(()))  # rank 0's RNG state travels in the checkpoint too
    metrics = engine.train_step(policy_loss, batch2, with_entropy=True)
    full = engine.full_state_dict()  # after step 2: depends on the restored Adam moments too
    return {"loss": metrics.get("loss"), "grad_norm": metrics["grad_norm"], "rng": rng, "exported_lp": exported,
            "dp_rank": engine.layout()["dp_rank"], "lr": engine.lr,
            "weights": {n: t.numpy() for n, t in full.items()} if rank == 0 else None}


def test_checkpoint_resume_in_fresh_processes_and_hf_export(paths, tmp_path):
    """Save after one step, end the processes, load into a fresh dp2 x pp2 group: the next step's loss,
    gradient norm, LR and the weights after it are identical to continuing without the restart. The HF export reloads in
    transformers with the engine's log-probs."""
    import torch

    from tests.workers.engines.reference import build_reference, make_batch, reference_outputs

    args = (paths[0], str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    straight = run_distributed(_train_save_or_resume, world_size=4, args=(*args, False), timeout_s=600)
    resumed = run_distributed(_train_save_or_resume, world_size=4, args=(*args, True), timeout_s=600)
    last = lambda rs: [r for r in rs if r["loss"] is not None]  # noqa: E731
    for a, b in zip(last(straight), last(resumed)):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    assert straight[0]["rng"] == resumed[0]["rng"]
    assert all(np.array_equal(straight[0]["weights"][n], resumed[0]["weights"][n]) for n in straight[0]["weights"])
    batch = make_batch(batch_size=BATCH, vocab=64, seed=4)
    with torch.no_grad():
        hf = reference_outputs(build_reference(str(tmp_path / "hf"), head="lm"), batch, head="lm")["log_probs"]
    engine_lp = np.concatenate([r["exported_lp"] for r in sorted(last(straight), key=lambda r: r["dp_rank"])])
    mask = batch["response_mask"].numpy().astype(bool)
    assert np.abs(hf.numpy() - engine_lp)[mask].max() < TOL
