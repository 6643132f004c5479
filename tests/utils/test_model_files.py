"""Model directories with weights only in pickle format are refused in the driver unless the user
opts in with model.allow_pickle_weights=true; safetensors directories pass."""

import pytest
import torch

from rlframe.config import ConfigError, load_config, validate


def model_dir(root, weights: str):
    root.mkdir()
    (root / "config.json").write_text("{}")
    (root / "training_args.bin").write_bytes(b"not weights")
    if weights == "bin":
        torch.save({"w": torch.zeros(2)}, root / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(2)}, str(root / "model.safetensors"))
        torch.save({"w": torch.zeros(2)}, root / "pytorch_model.bin")  # safetensors win over it
    return root


def weight_problems(*overrides) -> list[str]:
    try:
        validate(load_config("ppo_tiny", list(overrides)))
    except ConfigError as err:
        return [p for p in err.problems if "weights only in pickle format" in p]  # (tmp paths may say pickle)
    return []


def test_pickle_only_model_is_refused_with_why_and_how(tmp_path):
    bin_dir = model_dir(tmp_path / "bin", "bin")
    found = weight_problems(f"model.path={bin_dir}", f"reward.model_paths=[{bin_dir}]")
    assert len(found) == 2, found
    assert found[0].startswith(f"model.path='{bin_dir}' has weights only in pickle format (pytorch_model.bin)")
    assert "can run arbitrary code" in found[0] and "model.allow_pickle_weights=true" in found[0]
    assert "safe_serialization=True" in found[0]
    assert found[1].startswith("reward.model_paths[0]=")


@pytest.mark.parametrize("kind", ["bin", "safetensors"])
def test_opt_in_or_safetensors_pass(tmp_path, kind):
    d = model_dir(tmp_path / kind, kind)
    extra = ["model.allow_pickle_weights=true"] if kind == "bin" else []
    assert weight_problems(f"model.path={d}", *extra) == []
