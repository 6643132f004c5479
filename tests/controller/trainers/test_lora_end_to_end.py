"""LoRA runs end to end on real Ray, FSDP, vLLM and gloo (hybrid engine and split placement): only the
adapters change and only they are synced (bytes received = the adapters' slices the plan computes),
the reference policy is the actor's base model (no reference group), and the export holds a PEFT
adapter that, applied to the base model, gives the exported merged model."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlframe.controller.trainers.prepare import model_path
from tests.controller.trainers.test_end_to_end import run

LORA = ["data.train_batch_size=4", "actor.lora_rank=4", "actor.lora_alpha=8", "actor.lr=1e-2",
        "actor.lora_target_modules=[q_proj,v_proj,down_proj]", "trainer.val_every=0"]
# layout: (overrides, the share of the adapter a generation rank already holds as a training shard)
LAYOUTS = {
    "hybrid": ([], 1 / 2),  # FSDP dp=2 in the same processes: each rank holds half of every factor (dim 0)
    "split": (["resources.placement=split", "actor.dp=1", "+resources.split_procs={actor: 1, rollout: 1}"], 0.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_run_trains_and_syncs_only_adapters(layout, tmp_path, ray_cluster):
    overrides, held = LAYOUTS[layout]
    cfg, summary = run("grpo_tiny", LORA + overrides, tmp_path)
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step2 = next(r for r in rows if r["step"] == 2)  # the first step after an update syncs

    export = Path(summary["hf_export"])
    adapter = load_file(str(export / "adapter" / "adapter_model.safetensors"))
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"] and config["r"] == 4
    # a generation rank keeps the whole adapter at rollout tp=1: exactly the part it does not hold arrives
    adapter_bytes = sum(t.numel() * 4 for t in adapter.values())
    assert step2["reshard/bytes_received_mb"] * 2**20 == adapter_bytes * (1 - held)
    assert "actor/reference_kl" in step2 and step2["actor/reference_kl"] >= 0.0

    start = load_file(str(Path(model_path(cfg)) / "model.safetensors"))
    merged = load_file(str(export / "model.safetensors"))
    scaling = config["lora_alpha"] / config["r"]
    changed = []
    for name, w in start.items():
        stem = name.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{stem}.lora_A.weight")
        if a is None:  # not adapted: the base weights are frozen, bit for bit
            assert torch.equal(merged[name], w), name
            continue
        b = adapter[f"base_model.model.{stem}.lora_B.weight"]
        torch.testing.assert_close(merged[name], w + scaling * b @ a, rtol=0, atol=1e-6)
        changed.append(bool(b.abs().sum() > 0))
    assert changed and all(changed), "some adapted projection kept lora_B at zero"
