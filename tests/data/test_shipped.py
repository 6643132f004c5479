"""The pre-trained demo model ships in the repository: loaded byte for byte, verified, never trained."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rlframe.config.schema import RunConfig
from rlframe.data import pretrain, rebuild, shipped
from rlframe.data.pretrain import DEFAULT_SFT, SFTConfig, build_pretrained_model, cache_key

DEMO = shipped.PRESETS_DIR / "demo"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pre-training ran, but the shipped model should have been used")

    monkeypatch.setattr(pretrain, "_train_in_child", refuse)


@pytest.mark.parametrize("name", sorted(shipped.RECIPES))
def test_each_shipped_model_is_its_default_recipe(name):
    folder = shipped.PRESETS_DIR / name
    manifest = shipped.read_manifest(folder)
    recipe = shipped.RECIPES[name]
    assert manifest["cache_key"] == cache_key(**recipe, cfg=DEFAULT_SFT.get(recipe["task"], SFTConfig()))
    assert set(manifest["sha256"]) == {p.name for p in folder.iterdir()} - {shipped.MANIFEST}
    assert shipped.verify_shipped(folder) == manifest["sha256"]
    info = json.loads((folder / "rlframe_pretrain.json").read_text())
    assert info["weights_sha256"] == manifest["sha256"]["model.safetensors"]  # what a build wrote


def test_loading_the_preset_gives_the_shipped_bytes_without_training(tmp_path, no_training):
    path = build_pretrained_model(preset="demo", task="arithmetic", seed=0, cache_dir=tmp_path)
    assert path.parent == tmp_path / "models"
    sums = shipped.read_manifest(DEMO)["sha256"]
    assert {p.name: _sha(p) for p in path.iterdir()} == sums
    assert _sha(path / "model.safetensors") == _sha(DEMO / "model.safetensors")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert build_pretrained_model(preset="demo", seed=0, cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # verified, not copied again


def test_a_run_starts_from_the_shipped_model_whatever_its_data_seed(tmp_path, no_training):
    from rlframe.controller.trainers.prepare import model_path

    paths = set()
    for seed in (0, 5):
        cfg = RunConfig()
        cfg.model.cache_dir, cfg.data.seed = str(tmp_path), seed
        paths.add(model_path(cfg))
    (path,) = paths
    assert _sha(Path(path) / "model.safetensors") == _sha(DEMO / "model.safetensors")


def test_a_corrupted_shipped_file_is_refused(tmp_path, monkeypatch, no_training):
    presets = tmp_path / "presets"
    shutil.copytree(DEMO, presets / "demo")
    weights = presets / "demo" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(shipped, "PRESETS_DIR", presets)
    with pytest.raises(shipped.ShippedModelError, match=r"model\.safetensors.*sha256 differs.*git checkout.*rlframe.data.rebuild demo"):
        build_pretrained_model(preset="demo", seed=0, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_a_damaged_cache_copy_is_replaced(tmp_path, no_training):
    path = build_pretrained_model(preset="demo", seed=0, cache_dir=tmp_path)
    (path / "model.safetensors").write_bytes(b"not a model")
    assert build_pretrained_model(preset="demo", seed=0, cache_dir=tmp_path) == path
    assert _sha(path / "model.safetensors") == _sha(DEMO / "model.safetensors")


def test_other_recipes_are_not_shipped():
    assert shipped.find_shipped(cache_key(preset="demo", task="arithmetic", seed=1, cfg=SFTConfig())) is None
    assert shipped.find_shipped(cache_key(preset="demo", task="arithmetic", seed=0, cfg=SFTConfig(steps=10))) is None


def test_rebuild_writes_the_built_files_and_their_sums(tmp_path, monkeypatch):
    built = tmp_path / "built"
    built.mkdir()
    (built / "model.safetensors").write_bytes(b"weights")
    (built / "config.json").write_text("{}")
    calls = []

    def fake_build(**kwargs):
        calls.append(kwargs)
        return built

    monkeypatch.setattr(pretrain, "build_pretrained_model", fake_build)
    out = rebuild.rebuild("demo", presets_dir=tmp_path / "presets")
    assert calls[0]["use_shipped"] is False and calls[0]["preset"] == "demo"
    manifest = shipped.read_manifest(out)
    assert manifest["sha256"] == {"model.safetensors": _sha(built / "model.safetensors"),
                                  "config.json": _sha(built / "config.json")}
    assert manifest["cache_key"] == shipped.read_manifest(DEMO)["cache_key"]
    shipped.verify_shipped(out)


def test_the_shipped_files_are_tracked_by_git_and_packaged():
    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", *map(str, DEMO.iterdir())], cwd=root, capture_output=True)
    assert ignored.stdout == b""  # .gitignore excludes none of them
    assert '"rlframe.data": ["presets/*/*"]' in (root / "setup.py").read_text()
