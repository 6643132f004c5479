"""A checkpoint needs storage every rank sees: each node writing to its own local disk under the
same path is detected before any state is written (two real gloo processes; rank 1's "local disk"
is another directory, as a node-local path would be)."""

import os

from rlframe.utils.spawn import run_distributed


def _probe(rank, world, shared, local):
    from rlframe.workers.engines.checkpoint import SharedStorageError, check_shared_storage

    out = {}
    tmp = os.path.join(shared, "step_1.tmp")
    check_shared_storage(tmp, is_first=rank == 0, group=None)
    out["shared_ok"] = sorted(os.listdir(tmp))  # the probe is gone: nothing lands in the checkpoint
    elsewhere = os.path.join(shared if rank == 0 else local, "step_2.tmp")
    try:
        check_shared_storage(elsewhere, is_first=rank == 0, group=None)
        out["local_error"] = None
    except SharedStorageError as err:
        out["local_error"] = str(err)
    out["left_behind"] = os.path.exists(os.path.join(shared, "step_2.tmp"))
    return out


def test_node_local_checkpoint_storage_is_refused_on_every_rank(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "node1_local"
    local.mkdir()
    results = run_distributed(_probe, world_size=2, args=(str(shared), str(local)), timeout_s=120)
    for r in results:
        assert r["shared_ok"] == []
        assert r["local_error"] is not None and "not on storage shared by all ranks: ranks [1]" in r["local_error"]
        assert "trainer.output_dir" in r["local_error"]
        assert not r["left_behind"]
