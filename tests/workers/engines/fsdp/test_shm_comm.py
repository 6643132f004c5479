"""FSDP's collectives through shared memory (fsdp/shm_comm.py) on real gloo ranks: the same bytes
as gloo's all-gather and reduce-scatter (bit for bit at two ranks, where gloo adds a + b), and an
engine that uses them trains to bit-identical weights, an actor and a critic (whose 1-row value
head is sharded unevenly: empty on the second rank); ranks on several hosts keep gloo."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from rlframe.utils.spawn import run_distributed
from tests.workers.engines.reference import dp_slice, engine_on_mesh, make_batch, sft_loss, value_loss


def _collectives(rank, world):
    import torch
    import torch.distributed as dist

    from rlframe.workers.engines.fsdp.shm_comm import SharedMemoryComm

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(100 + rank)
    out = {}
    # a segment larger than every call, and one of 100 bytes: every call then goes in several chunks
    for size, comm in (("whole", SharedMemoryComm(group)), ("chunked", SharedMemoryComm(group, nbytes=100))):
        for n, dtype in ((5, torch.float32), (1000, torch.float32), (7, torch.bfloat16)):
            shard = torch.randn(n, generator=g).to(dtype)
            mine, ref = torch.empty(n * world, dtype=dtype), torch.empty(n * world, dtype=dtype)
            comm(mine, shard, group)
            dist.all_gather_into_tensor(ref, shard)
            out[f"{size}_all_gather_{n}_{dtype}"] = torch.equal(mine, ref)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            full = torch.randn(world * 333, generator=g)
            mine, ref = torch.empty(333), torch.empty(333)
            comm(mine, full, group, op=op)
            dist.reduce_scatter_tensor(ref, full.clone(), op=op)
            out[f"{size}_reduce_scatter_{op}"] = (torch.equal(mine, ref), float((mine - ref).abs().max()))
    try:  # ranks that disagree on the size would chunk differently: refused on every rank
        SharedMemoryComm(group, nbytes=100 + rank)
        out["refuses_unequal_sizes"] = False
    except ValueError as e:
        out["refuses_unequal_sizes"] = "different sizes" in str(e)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_match_gloo(world):
    for r in run_distributed(_collectives, world_size=world, timeout_s=120):
        for name, value in r.items():
            if "all_gather" in name or name == "refuses_unequal_sizes":
                assert value, name
            else:
                equal, diff = value
                assert equal if world == 2 else diff < 1e-5, (name, diff)


def _engines(rank, world, path):
    import rlframe.workers.engines.fsdp.shm_comm as shm_comm

    batch = make_batch(batch_size=8, seed=3)
    states, used = {}, {}
    for head, loss in (("lm", sft_loss), ("value", value_loss)):
        for shm in (False, None):
            engine = engine_on_mesh(path, dp=2, tp=1, world=world, head=head, micro_batch_size=2, lr=1e-3,
                                    shm_collectives=shm)
            mine, _ = dp_slice(batch, engine)
            losses = [engine.train_step(loss, mine)["loss"] for _ in range(3)]
            if head == "value":  # a forward after the steps gathers the trained shards
                losses.append(engine.forward_values(mine).sum().item())
            states[head, shm] = {k: v.numpy().copy() for k, v in engine.full_state_dict().items()}
            used[head, shm] = (engine.shm_collectives, losses)
    real = shm_comm.socket.gethostname
    if rank == 1:  # pretend the second rank is on another machine: shared memory does not apply
        shm_comm.socket.gethostname = lambda: real() + "-elsewhere"
    try:
        elsewhere = engine_on_mesh(path, dp=2, tp=1, world=world, lr=1e-3).shm_collectives
    finally:
        shm_comm.socket.gethostname = real
    return states, used, elsewhere


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rlframe.data.tiny_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("shm") / "m", preset="test", seed=0))


def test_engine_with_shared_memory_collectives_trains_bit_identically(model_path):
    for states, used, elsewhere in run_distributed(_engines, world_size=2, args=(model_path,), timeout_s=300):
        assert elsewhere is False
        for head in ("lm", "value"):
            (gloo_only, gloo_losses), (shm, shm_losses) = used[head, False], used[head, None]
            assert gloo_only is False and shm is True, head
            assert gloo_losses == shm_losses and gloo_losses[2] < gloo_losses[0], (head, gloo_losses, shm_losses)
            gloo_state, shm_state = states[head, False], states[head, None]
            assert gloo_state.keys() == shm_state.keys()
            for name in gloo_state:
                np.testing.assert_array_equal(gloo_state[name], shm_state[name], err_msg=f"{head}: {name}")


def _private_shm(rank, world, dirs, path):
    """Rank 1 looks for the segment in another directory, as in a container with its own /dev/shm."""
    import logging
    import os

    import torch
    import torch.distributed as dist

    from rlframe.workers.engines.fsdp import shm_comm

    os.environ[shm_comm.SHM_DIR_ENV] = dirs[rank]
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    shm_comm.logger.addHandler(handler)
    comm = shm_comm.SharedMemoryComm(dist.group.WORLD)
    g = torch.Generator().manual_seed(7 + rank)
    shard, full = torch.randn(1000, generator=g), torch.randn(world * 333, generator=g)
    gathered, ref = torch.empty(1000 * world), torch.empty(1000 * world)
    comm(gathered, shard, dist.group.WORLD)
    dist.all_gather_into_tensor(ref, shard)
    out = {"shared": comm.shared, "all_gather": torch.equal(gathered, ref)}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        mine, ref = torch.empty(333), torch.empty(333)
        comm(mine, full, dist.group.WORLD, op=op)
        dist.reduce_scatter_tensor(ref, full.clone(), op=op)
        out[f"reduce_scatter_{op}"] = torch.equal(mine, ref)
    out["engine_shm"] = engine_on_mesh(path, dp=2, tp=1, world=world, lr=1e-3).shm_collectives
    shm_comm.logger.removeHandler(handler)
    out["log"] = lines
    return out


def test_private_shm_of_one_rank_falls_back_to_gloo(model_path):
    """Same hostname, different /dev/shm: rank 1 must not create a file of zeros of its own, every
    rank keeps gloo (right sums), one line says why, and no file is left in either directory."""
    import tempfile

    dirs = [tempfile.mkdtemp(prefix="rlframe-test-shm-", dir="/dev/shm") for _ in range(2)]
    try:
        results = run_distributed(_private_shm, world_size=2, args=(dirs, model_path), timeout_s=180)
        for d in dirs:
            assert os.listdir(d) == [], (d, os.listdir(d))
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    for rank, out in enumerate(results):
        assert out.pop("shared") is False and out.pop("engine_shm") is False, rank
        log = out.pop("log")
        assert all(out.values()), (rank, out)
        if rank == 0:  # one line per segment tried: the comm above, then the engine's
            assert len(log) == 2 and all("rank 1: FileNotFoundError" in line and "keep gloo" in line
                                         for line in log), log
        else:
            assert log == []


def _die_during_setup(rank, world, directory, victim):
    """The victim rank is SIGKILLed once rank 0's segment file exists, before every rank mapped it."""
    import os
    import signal
    import time

    import torch.distributed as dist

    from rlframe.workers.engines.fsdp import shm_comm

    shm_comm.SHM_DIR = directory  # the default directory, where RLFRAME_SHM_DIR is not set
    kill = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if rank == victim == 0:  # right after creating (and sizing) the file
        real_fallocate = os.posix_fallocate
        os.posix_fallocate = lambda *a: (real_fallocate(*a), kill())
    elif rank == victim:  # at the barrier after rank 0 created it
        def barrier(*args, **kwargs):
            deadline = time.monotonic() + 30
            while not os.listdir(directory) and time.monotonic() < deadline:
                time.sleep(0.01)
            kill()
        dist.barrier = barrier
    shm_comm.SharedMemoryComm(dist.group.WORLD)
    return "set up"


@pytest.mark.parametrize("victim", [0, 1])
def test_rank_killed_during_setup_leaves_nothing_in_shm(victim):
    import tempfile

    from rlframe.utils.spawn import DistributedRunError

    directory = tempfile.mkdtemp(prefix="rlframe-test-shm-", dir="/dev/shm")
    try:
        with pytest.raises(DistributedRunError):
            run_distributed(_die_during_setup, world_size=2, args=(directory, victim), timeout_s=60)
        assert os.listdir(directory) == [], os.listdir(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
