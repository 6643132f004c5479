"""The driver's checkpoint manager on real directories: resume=auto skips damaged checkpoints,
an explicit damaged path fails naming the file, retention never deletes the newest verified one."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlframe.controller.lifecycle.checkpoint import NEARLY_FULL_BYTES, CheckpointManager
from rlframe.utils.manifest import CheckpointDamaged, write_manifest


def role_writer(*, tamper: bool = False):
    """save_roles for the manager: an 'actor' engine directory with its own manifest, as the engines
    write it; `tamper` changes a shard after the engine hashed it (a bad disk or node)."""

    def save_roles(tmp):
        role = tmp / "actor"
        (role / "model_optim").mkdir(parents=True)
        for rank in range(2):
            (role / "model_optim" / f"__{rank}_0.distcp").write_bytes(os.urandom(4096))
        (role / "engine_state.pt").write_bytes(os.urandom(512))
        write_manifest(role)
        if tamper:
            with open(role / "model_optim" / "__1_0.distcp", "r+b") as f:
                f.write(b"\0" * 16)

    return save_roles


def save(mgr, step, **kw):
    return mgr.save(step, save_roles=role_writer(**kw), state={"dataloader": {"epoch": 0, "pos": step}})


def truncate(path, size=100):
    with open(path, "r+b") as f:
        f.truncate(size)


def flip_byte(path, at=10):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_auto_skips_damaged_newest_and_explicit_path_fails(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    older, newest = save(mgr, 2), save(mgr, 4)
    truncate(newest / "actor" / "model_optim" / "__0_0.distcp")
    flip_byte(newest / "actor" / "engine_state.pt")
    with pytest.warns(UserWarning, match="skipping .*step_000004") as caught:
        assert mgr.resolve("auto") == older
    said = str(caught[0].message)
    assert "actor/model_optim/__0_0.distcp has 100 bytes" in said and "actor/engine_state.pt has changed" in said
    assert mgr.load_state(older)["dataloader"]["pos"] == 2

    with pytest.raises(CheckpointDamaged, match=r"actor/model_optim/__0_0\.distcp has 100 bytes"):
        mgr.resolve(str(newest))
    assert mgr.resolve(str(older)) == older

    flip_byte(older / "trainer_state.json", at=2)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="none of the 2 checkpoints .* trainer.resume=off"):
        mgr.resolve("auto")


def test_retention_keeps_the_newest_verified_until_a_newer_one_verifies(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1)
    first = save(mgr, 1)
    with pytest.warns(UserWarning, match=r"step_000002: actor/model_optim/__1_0\.distcp has changed"):
        bad = save(mgr, 2, tamper=True)
    assert first.is_dir() and bad.is_dir(), "step 1 is the newest verified checkpoint: it must stay"
    third = save(mgr, 3)
    assert [p for _, p in mgr.complete()] == [third]


def test_retention_keeps_the_checkpoint_just_saved_below_a_left_branch(tmp_path):
    """Resumed from an explicit older checkpoint (step 2, beside a step 4 it left behind), the run saves
    step 3: with keep=1 the step just saved stays (it is the run's progress; it was deleted at once, the
    newest by number being step 4), and step 4, the newest by number, stays too."""
    mgr = CheckpointManager(tmp_path, keep=2)
    save(mgr, 2)
    left = save(mgr, 4)
    mgr.keep = 1
    mine = save(mgr, 3)
    assert mine.is_dir() and left.is_dir(), [p.name for _, p in mgr.complete()]


def test_main_fails_before_ray_naming_the_damaged_file(tmp_path):
    """`python -m rlframe.main trainer.resume=DAMAGED` stops in the driver's config check (before Ray or
    any worker starts), exit code 2, the file named, no traceback."""
    damaged = save(CheckpointManager(tmp_path, keep=1), 7)
    flip_byte(damaged / "actor" / "model_optim" / "__1_0.distcp")
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-m", "rlframe.main", f"trainer.resume={damaged}"], cwd=repo,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 2, proc.stderr
    assert "actor/model_optim/__1_0.distcp has changed since it was written" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Started a local Ray" not in proc.stderr  # stopped before Ray (or any worker) started


def test_a_write_that_fills_the_disk_removes_its_partial_directory(tmp_path):
    import errno

    from rlframe.controller.lifecycle.checkpoint import CheckpointManager, CheckpointWriteFailed

    mgr = CheckpointManager(tmp_path, keep=2)

    def fill(tmp):
        (tmp / "actor").mkdir()
        (tmp / "actor" / "shard").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteFailed, match=r"checkpoint of step 3 not written .*the disk filled up.*newest "
                                                    r"intact checkpoint: none"):
        mgr.save(3, save_roles=fill, state={})
    assert list((tmp_path / "checkpoints").iterdir()) == []

    def worker_died(tmp):
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):  # not a disk problem: passed on as it is
        mgr.save(3, save_roles=worker_died, state={})
    assert list((tmp_path / "checkpoints").iterdir()) == []



@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a filesystem that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_first_checkpoint_too_big_for_the_disk_is_refused_before_writing(small_disk):
    """Before any checkpoint gives a size, the estimate from the model and optimizer state decides."""
    from rlframe.controller.lifecycle.checkpoint import CheckpointWriteFailed

    written = []
    mgr = CheckpointManager(small_disk, keep=2, estimate_bytes=8 * 2**20)
    with pytest.raises(CheckpointWriteFailed) as caught:
        mgr.save(1, save_roles=written.append, state={})
    line = str(caught.value)
    assert "\n" not in line and line.startswith("checkpoint of step 1 not written in ")
    assert "not enough free space (the size estimated from the model and optimizer state)" in line
    assert "needs about 8.0 MiB" in line and "MiB are free" in line and "newest intact checkpoint: none" in line
    assert written == [] and list((small_disk / "checkpoints").iterdir()) == []

    mgr.estimate_bytes = 2**10  # one that fits is written
    assert mgr.save(1, save_roles=role_writer(), state={}).name == "step_000001"


def test_the_zip_writers_error_on_a_full_disk_is_out_of_space(small_disk, tmp_path):
    """torch.save's zip writer says only "unexpected pos N vs M" when the disk fills up; the manager
    confirms the disk is full (statvfs) and reports it as the one line of a full disk."""
    import torch

    from rlframe.controller.lifecycle.checkpoint import CheckpointWriteFailed

    def save_roles(tmp):
        (tmp / "actor").mkdir()
        torch.save({"w": torch.zeros(2**19)}, tmp / "actor" / "model.pt")  # 2 MiB on a 1 MiB disk

    mgr = CheckpointManager(small_disk, keep=2)
    with pytest.raises(CheckpointWriteFailed) as caught:
        mgr.save(1, save_roles=save_roles, state={})
    line = str(caught.value)
    assert "\n" not in line and "the disk filled up (" in line and "unexpected pos" in line, line
    assert list((small_disk / "checkpoints").iterdir()) == []  # the partial directory is gone

    def other_zip_failure(tmp):  # the same words with room on the disk: not taken for a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    roomy = tmp_path / "roomy"  # on the disk pytest's directories are on
    if shutil.disk_usage(tmp_path).free < 2 * NEARLY_FULL_BYTES:
        pytest.skip(f"too little free space to tell a full disk from another failure ({tmp_path})")
    with pytest.raises(RuntimeError, match="unexpected pos") as caught:
        CheckpointManager(roomy, keep=2).save(1, save_roles=other_zip_failure, state={})
    assert not isinstance(caught.value, CheckpointWriteFailed)

def test_partial_directories_of_earlier_attempts_are_removed_when_a_run_binds(tmp_path):
    from rlframe.controller.lifecycle.checkpoint import CheckpointManager

    left = tmp_path / "checkpoints" / ".tmp-step_000006"
    left.mkdir(parents=True)
    (left / "half").write_bytes(b"x")
    mgr = CheckpointManager(tmp_path, keep=2)
    assert mgr.remove_partial() == [left] and not left.exists()
