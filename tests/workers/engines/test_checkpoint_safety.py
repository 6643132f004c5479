"""Engine checkpoints on 2 real gloo ranks (fsdp, dp=2): verified before anything is loaded, and no
file in them can run code when loaded.

Each attack writes a pickle whose unpickling would create a marker file, then rewrites the
checkpoint's manifest (an attacker who writes the files can write a matching manifest too), so the
load gets past verification and reaches the unpickling: it must fail with a clear error and the
marker must not appear. Damage without a new manifest fails verification on every rank, naming the file.
"""

import os
import pickle
from pathlib import Path

import pytest
import torch

from rlframe.utils.manifest import write_manifest
from rlframe.utils.spawn import run_distributed


class Payload:
    """Unpickling this runs `touch marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _engine(path):
    from torch.distributed.device_mesh import init_device_mesh

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    cfg = TrainEngineConfig(model_path=path, head="lm", dp=2, tp=1, lr=1e-3)
    return get_train_engine("fsdp")(cfg, device_mesh=mesh)


def _load_error(engine, ck) -> str | None:
    try:
        engine.load_checkpoint(ck)
    except Exception as err:  # noqa: BLE001 - the test asserts the message
        return f"{type(err).__name__}: {err}"
    return None


def _attack(rank, ck, write) -> None:
    """Rank 0 replaces a file and re-writes the manifest once every rank has finished the last load;
    the others wait for it."""
    torch.distributed.barrier()
    if rank == 0:
        write()
        write_manifest(ck)
    torch.distributed.barrier()


def _save_and_attack(rank, world, model, out):
    from tests.workers.engines.reference import make_batch, sft_loss

    engine = _engine(model)
    batch = {k: v[rank * 4:(rank + 1) * 4] for k, v in make_batch(seed=1).items()}
    engine.train_step(sft_loss, batch)
    ck, marker = f"{out}/ck", f"{out}/marker"
    engine.save_checkpoint(ck)
    errors = {"clean": _load_error(engine, ck)}

    def poison_engine_state():  # rank 0 only: another rank reading the file meanwhile would race it
        state = torch.load(f"{ck}/engine_state.pt", weights_only=True)
        torch.save({**state, "steps": Payload(marker)}, f"{ck}/engine_state.pt")

    _attack(rank, ck, poison_engine_state)
    errors["engine_state"] = _load_error(engine, ck)

    engine.save_checkpoint(ck)
    _attack(rank, ck, lambda: Path(f"{ck}/model_optim/.metadata").write_bytes(pickle.dumps(Payload(marker))))
    errors["dcp_metadata"] = _load_error(engine, ck)

    engine.save_checkpoint(ck)
    torch.distributed.barrier()
    if rank == 0:
        with open(f"{ck}/model_optim/__1_0.distcp", "r+b") as f:
            f.truncate(1000)
    torch.distributed.barrier()
    errors["truncated"] = _load_error(engine, ck)
    return errors


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from rlframe.data.tiny_model import build_random_model

    root = tmp_path_factory.mktemp("ck_safety")
    model = build_random_model(root / "model", preset="test", seed=0)
    return run_distributed(_save_and_attack, world_size=2, args=(str(model), str(root)), timeout_s=300), root


def test_clean_checkpoint_loads(results):
    per_rank, _ = results
    assert [r["clean"] for r in per_rank] == [None, None]


def test_pickled_code_never_runs(results):
    per_rank, root = results
    assert not (root / "marker").exists(), "a payload in the checkpoint ran on load"
    for r in per_rank:
        assert "engine_state.pt holds Python objects that torch.load(weights_only=True) refuses" in r["engine_state"]
        assert "posix.system" in r["engine_state"] and "custom engine_state()" in r["engine_state"]
        assert "model_optim/.metadata refers to posix.system" in r["dcp_metadata"]
        assert "refuses to unpickle it because it could run code" in r["dcp_metadata"]


def test_damaged_shard_is_named_on_every_rank_before_loading(results):
    per_rank, _ = results
    for r in per_rank:
        assert r["truncated"].startswith("CheckpointDamaged"), r["truncated"]
        assert "model_optim/__1_0.distcp has 1000 bytes" in r["truncated"]
