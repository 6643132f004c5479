"""Manifests name every file that differs from what was written: truncated, changed, missing, added."""

import json
import os

import pytest

from rlframe.utils import manifest
from rlframe.utils.manifest import CheckpointDamaged, verify, write_manifest


def make_dir(root):
    (root / "shards").mkdir(parents=True)
    (root / "shards" / "a.bin").write_bytes(os.urandom(10_000))
    (root / "shards" / "b.bin").write_bytes(os.urandom(5_000))
    (root / "state.json").write_text('{"step": 3}')
    return root


def flip_byte(path, at=100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def problems_of(root) -> list[str]:
    with pytest.raises(CheckpointDamaged) as err:
        verify(root)
    assert str(root) in str(err.value) and "resume=auto" in str(err.value)  # what, and how to fix
    return err.value.problems


def test_written_manifest_verifies_and_lists_every_file(tmp_path):
    root = make_dir(tmp_path / "ck")
    files = write_manifest(root)
    assert sorted(files) == ["shards/a.bin", "shards/b.bin", "state.json"]
    assert files["shards/a.bin"]["size"] == 10_000
    verify(root)
    assert manifest.main(["verify", str(root)]) == 0


def test_truncated_and_flipped_files_are_both_named(tmp_path):
    root = make_dir(tmp_path / "ck")
    write_manifest(root)
    with open(root / "shards" / "a.bin", "r+b") as f:
        f.truncate(4_000)
    flip_byte(root / "shards" / "b.bin")
    found = problems_of(root)
    assert len(found) == 2
    assert "shards/a.bin has 4000 bytes where the manifest says 10000" in found[0]
    assert "shards/b.bin has changed" in found[1]
    assert manifest.main(["verify", str(root)]) == 1


def test_missing_added_and_manifestless(tmp_path):
    root = make_dir(tmp_path / "ck")
    write_manifest(root)
    (root / "shards" / "b.bin").unlink()
    (root / "extra.pt").write_bytes(b"x")
    found = problems_of(root)
    assert any("extra.pt is not in the manifest" in p for p in found)
    assert any("shards/b.bin is missing" in p for p in found)
    (root / manifest.MANIFEST).unlink()
    assert "no MANIFEST.json" in problems_of(root)[0]
    (root / manifest.MANIFEST).write_text(json.dumps({"format": manifest.FORMAT, "files": {"../x": {}}}))
    assert "not a readable" in problems_of(root)[0]


def test_nested_manifests_are_reused_so_damage_under_them_is_caught(tmp_path):
    """A run checkpoint reuses its roles' manifests: a role file changed after the role hashed it
    fails the run checkpoint's verification too (nothing is hashed twice at save time)."""
    root = make_dir(tmp_path / "run")
    role = make_dir(root / "actor")
    write_manifest(role)
    flip_byte(role / "shards" / "a.bin")  # after the role wrote its manifest
    write_manifest(root)
    assert problems_of(root) == ["actor/shards/a.bin has changed since it was written (its sha256 differs "
                                 "from the manifest)"]
