"""What an engine takes from its checkpoint and what from its config, the same in both backends, on
2 real gloo ranks (dp=2, fresh processes for the load as a resumed run has):

- every rank gets its own RNG states back (torch, numpy, python; before, rank 0's torch state was
  restored on every rank);
- the optimizer's hyper-parameters come from the loading engine's config (lr, weight decay, betas,
  eps), the schedule's position from the checkpoint: a learning rate changed for a resumed run is
  the one its next step uses (before, the fsdp engine kept the saved LR, megatron took the new one).
"""

import random

import numpy as np
import pytest

from rlframe.utils.spawn import run_distributed

BATCH = 8
SCHEDULE = dict(lr_schedule="cosine", total_steps=10, min_lr_ratio=0.1)


def _engine(backend, path, *, lr, weight_decay, eps):
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    cfg = TrainEngineConfig(model_path=path, head="lm", dp=2, lr=lr, weight_decay=weight_decay, eps=eps,
                            micro_batch_size=2, **SCHEDULE)
    if backend == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        return get_train_engine("fsdp")(cfg, device_mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")))
    return get_train_engine("megatron")(cfg)


def _draws() -> list:
    import torch

    return [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]]


def _save_or_load(rank, world, backend, path, ckpt, load):
    import torch

    from tests.workers.engines.reference import make_batch, sft_loss

    batch = {k: v[rank * 4:(rank + 1) * 4] for k, v in make_batch(batch_size=BATCH, vocab=64, seed=1).items()}
    if not load:
        engine = _engine(backend, path, lr=1e-3, weight_decay=0.0, eps=1e-8)
        engine.train_step(sft_loss, batch)
        torch.manual_seed(1000 + rank)  # each rank's own streams
        np.random.seed(2000 + rank)
        random.seed(3000 + rank)
        engine.save_checkpoint(ckpt)
        return {"draws": _draws()}
    engine = _engine(backend, path, lr=5e-4, weight_decay=0.1, eps=1e-6)  # the resumed run's settings
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    engine.load_checkpoint(ckpt)
    draws = _draws()
    lr_after_load = engine.lr
    groups = [(g["lr"], g["weight_decay"], g["eps"]) for g in engine.optimizer.param_groups]
    step = engine.train_step(sft_loss, batch)
    return {"draws": draws, "lr_after_load": lr_after_load, "step_lr": step["lr"], "groups": groups}


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    from tests.workers.engines.megatron.models import build_hf_model

    return build_hf_model(str(tmp_path_factory.mktemp("resume_state") / "lm"), "qwen2")


@pytest.fixture(scope="module", params=["fsdp", "megatron"])
def runs(request, lm_path, tmp_path_factory):
    """(backend, per-rank results of the saving processes, per-rank results of the loading ones)."""
    backend = request.param
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    ckpt = str(tmp_path_factory.mktemp(f"ckpt_{backend}") / "ckpt")
    saved = run_distributed(_save_or_load, world_size=2, args=(backend, lm_path, ckpt, False), timeout_s=600)
    loaded = run_distributed(_save_or_load, world_size=2, args=(backend, lm_path, ckpt, True), timeout_s=600)
    return backend, saved, loaded


def test_each_rank_gets_its_own_rng_states_back(runs):
    backend, saved, loaded = runs
    assert saved[0]["draws"] != saved[1]["draws"]  # the ranks' streams differ...
    for rank in (0, 1):  # ...and each comes back to its own rank: torch, numpy and python
        assert loaded[rank]["draws"] == saved[rank]["draws"], f"{backend}: rank {rank} did not get its RNG back"


def test_the_loading_config_sets_lr_weight_decay_and_eps(runs):
    from rlframe.workers.engines.optim import lr_lambda

    backend, _, loaded = runs
    want = 5e-4 * lr_lambda(1, schedule="cosine", warmup_steps=0, min_lr_ratio=0.1, total_steps=10)
    for r in loaded:
        assert r["lr_after_load"] == pytest.approx(want, rel=1e-12), (backend, r["lr_after_load"], want)
        assert r["step_lr"] == pytest.approx(want, rel=1e-12)
        decays = {round(wd, 12) for _, wd, _ in r["groups"]}
        assert decays <= {0.0, 0.1} and 0.1 in decays, (backend, r["groups"])  # matrices decay at the new rate
        assert {eps for _, _, eps in r["groups"]} == {1e-6}, (backend, r["groups"])
