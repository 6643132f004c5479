"""benchmarks/gpu_smoke.py's cases are configs the validation accepts (split placement: refuses, with
the message the script looks for), so a GPU run does not spend its time on a typo."""

import importlib.util
import re
from pathlib import Path

import pytest

from rlframe.config.load import load_config
from rlframe.config.validate import ConfigError, validate

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"


def _smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_case_validates_or_is_refused_as_expected():
    smoke = _smoke()
    cases = smoke.cases([1, 2, 8], ["tiny"])
    assert {c["layout"] for c in cases} >= {"fsdp", "fsdp-tp2", "fsdp-sp2", "megatron-tp2-pp2", "split (refused)"}
    assert [c["refusal"] for c in smoke.cases([2], ["0.5b"]) if c["layout"].startswith("megatron")] == [smoke.TIED_REFUSAL]
    for case in cases:
        cfg = load_config("grpo_tiny", smoke.JOB + ["model.tiny_preset=demo", "trainer.dry_run=true",
                                                    *case["overrides"]])
        assert cfg.resources.use_gpu and cfg.resources.procs_per_node == case["gpus"]
        if case["refusal"]:
            with pytest.raises(ConfigError, match=re.escape(case["refusal"])):
                validate(cfg)
        else:
            validate(cfg)
            assert cfg.actor.dp * cfg.actor.sp * cfg.actor.tp * cfg.actor.pp == case["gpus"]
            assert cfg.data.train_batch_size * cfg.algorithm.n_samples > cfg.actor.mini_batch_size  # > 1 mini-batch
