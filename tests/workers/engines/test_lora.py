"""LoRA in the fsdp engine, on 2 real gloo processes.

One spawn runs dp1-tp1 (the single-process reference, once per rank), dp2-tp1, dp1-tp2 and dp2-tp1
under FSDP's ZeRO-3 schedule LoRA engines side by side on a ("rep", "dp", "tp") mesh and checks, within 1e-5 (fp32):
- log-probs, loss and adapter weights agree across layouts over two steps (the first step makes
  lora_B nonzero, so the second compares a real adapter);
- the base weights stay bit-identical and the optimizer holds state only for adapters;
- adapters disabled reproduce a LoRA-free engine's log-probs exactly;
- each rank's adapter shards are the boxes the resharding layout predicts;
- a checkpoint round trip continues training identically, and a mismatched config is refused;
- the export: PEFT loads the adapter directory, and its logits equal the merged HF model's and the
  engine's log-probs (for a critic: values, with the value head saved in the adapter).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlframe.utils.spawn import run_distributed
from tests.workers.engines.reference import (
    dp_slice, engine_on_mesh, make_batch, max_abs_diff, policy_loss, reference_outputs, value_loss,
)

TOL = 1e-5
HP = dict(lr=3e-3, weight_decay=0.1, eps=1e-6, grad_clip=1.0, lora_rank=4, lora_alpha=8.0)
# (dp, tp, engine overrides); the last is FSDP's ZeRO-3 schedule (the GPU default) with uneven
# token-budget micro-batches over the dp ranks
LAYOUTS = [(1, 1, {}), (2, 1, {}), (1, 2, {}), (2, 1, {"gather_once_per_step": False, "max_tokens_per_micro_batch": 20})]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rlframe.data.tiny_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("lora_model") / "qwen2", preset="test", seed=0))


def _engine(path, *, dp, tp, world, head="lm", **overrides):
    return engine_on_mesh(path, dp=dp, tp=tp, world=world, head=head, **{**HP, **overrides})


def _split(state: dict):
    from rlframe.workers.engines.lora import is_adapter_name

    return ({k: v for k, v in state.items() if is_adapter_name(k)},
            {k: v for k, v in state.items() if not is_adapter_name(k)})


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(max_abs_diff(a[k], b[k]) for k in a)


def _run_layout(path, dp, tp, world, batch, **overrides):
    """Two LoRA steps; per step: log-probs, loss, grad norm, adapters after it. Plus invariants."""
    engine = _engine(path, dp=dp, tp=tp, world=world, **overrides)
    adapters0, base0 = _split(engine.full_state_dict())
    mine, rows = dp_slice(batch, engine)
    steps = []
    for _ in range(2):
        out = engine.forward_log_probs(mine, with_entropy=True)
        m = engine.train_step(policy_loss, mine, with_entropy=True)
        adapters, base = _split(engine.full_state_dict())
        steps.append({"log_probs": out["log_probs"], "loss": m["loss"], "grad_norm": m["grad_norm"],
                      "adapters": adapters})
    facts = {
        "base_bit_identical": all(torch.equal(base[k], base0[k]) for k in base0),
        "lora_B_was_zero": all(not v.any() for k, v in adapters0.items() if k.endswith("lora_B.weight")),
        "lora_B_nonzero_after": all(v.any() for k, v in steps[0]["adapters"].items() if k.endswith("lora_B.weight")),
        "lora_A_changed": all(not torch.equal(steps[1]["adapters"][k], v) for k, v in adapters0.items()
                              if k.endswith("lora_A.weight")),
    }
    # The optimizer holds only adapters: no state and no param group entry for a frozen weight.
    names = {id(p): n for n, p in engine.model.named_parameters()}
    in_optim = [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
    with_state = [names[id(p)] for p in engine.optimizer.state]
    facts["optimizer_only_adapters"] = (sorted(in_optim) == sorted(with_state) == sorted(adapters0)
                                         and all(not p.requires_grad for n, p in engine.model.named_parameters()
                                                 if n not in adapters0))
    facts["adapter_shards_match_layout"] = _adapter_boxes_ok(engine, steps[1]["adapters"])
    facts["base_shards_unchanged_names"] = sorted(engine.local_shards()) == sorted(base0)
    return engine, steps, rows, facts


def _adapter_boxes_ok(engine, truth) -> bool:
    layout, rank = engine.resharding_layout(), engine.layout()["rank"]
    shards = engine.lora_local_shards()
    if sorted(shards) != sorted(truth):
        return False
    for name, (shape, box, local) in shards.items():
        expected = layout.box(name, shape, rank)
        if not ((expected is None and box.empty) or expected == box):
            return False
        if not box.empty and max_abs_diff(local, truth[name][box.slices()]) > 0:
            return False
    return True


def _all(rank, world, path, out_dir):
    batch = make_batch()
    errors: dict[str, float] = {}
    facts: dict[str, bool] = {}
    runs = {}
    for dp, tp, overrides in LAYOUTS:
        tag = f"dp{dp}tp{tp}" + ("/zero3" if overrides else "")
        engine, steps, rows, f = _run_layout(path, dp, tp, world, batch, **overrides)
        runs[tag] = (engine, steps, rows)
        facts.update({f"{tag}/{k}": v for k, v in f.items()})
    _, ref_steps, _ = runs["dp1tp1"]
    for name, (engine, steps, rows) in runs.items():
        mask = batch["response_mask"][rows]
        for i, (got, ref) in enumerate(zip(steps, ref_steps)):
            tag = f"{name}/step{i}"
            errors[f"{tag}/log_probs"] = max_abs_diff(got["log_probs"], ref["log_probs"][rows], mask)
            errors[f"{tag}/loss"] = abs(got["loss"] - ref["loss"])
            errors[f"{tag}/grad_norm"] = abs(got["grad_norm"] - ref["grad_norm"])
            errors[f"{tag}/adapters"] = _diff(got["adapters"], ref["adapters"])

    # Adapters off == the model without LoRA (same layout, same base weights).
    for dp, tp in ((2, 1), (1, 2)):
        engine, _, rows = runs[f"dp{dp}tp{tp}"]
        plain = _engine(path, dp=dp, tp=tp, world=world, lora_rank=0)
        mine, _ = dp_slice(batch, engine)
        base_lp = plain.forward_log_probs(mine)["log_probs"]
        off = engine.forward_log_probs(mine, disable_adapter=True)["log_probs"]
        on = engine.forward_log_probs(mine)["log_probs"]
        facts[f"dp{dp}tp{tp}/disabled_equals_base_exactly"] = max_abs_diff(off, base_lp, mine["response_mask"]) == 0.0
        facts[f"dp{dp}tp{tp}/disabled_differs_from_enabled"] = max_abs_diff(on, off, mine["response_mask"]) > 1e-4
        facts[f"dp{dp}tp{tp}/plain_refuses_disable"] = _raises(lambda: plain.forward_log_probs(mine, disable_adapter=True),
                                                               "no LoRA adapters")

    # Critic with LoRA: the value head trains with the adapters, the base stays.
    critic = _engine(path, dp=2, tp=1, world=world, head="value")
    _, cbase0 = _split(critic.full_state_dict())
    full0 = critic.full_state_dict()
    mine, _ = dp_slice(batch, critic)
    critic.train_step(value_loss, mine)
    critic.train_step(value_loss, mine)
    cad, cbase = _split(critic.full_state_dict())
    facts["critic/base_frozen_but_score"] = all(torch.equal(cbase[k], cbase0[k]) == (not k.startswith("score."))
                                                for k in cbase0)
    facts["critic/adapters_trained"] = all(not torch.equal(cad[k], full0[k]) for k in cad)
    critic.export_hf(f"{out_dir}/critic_export")
    critic_values = critic.forward_values(mine).numpy()
    critic_rows = dp_slice(batch, critic)[1]

    engine, _, rows = runs["dp1tp2"]
    ckpt = _checkpoint_round_trip(engine, path, world, batch, errors, facts, out_dir)
    engine.export_hf(f"{out_dir}/export")
    mine, rows = dp_slice(batch, engine)
    exported = engine.forward_log_probs(mine)["log_probs"].numpy()
    return {"errors": errors, "facts": facts, "exported": exported, "rows": (rows.start, rows.stop), "ckpt": ckpt,
            "critic_values": critic_values, "critic_rows": (critic_rows.start, critic_rows.stop)}


def _raises(fn, text) -> bool:
    try:
        fn()
    except ValueError as e:
        return text in str(e)
    return False


def _checkpoint_round_trip(engine, path, world, batch, errors, facts, out_dir):
    """Save after two steps, take a third; a fresh engine loads and takes the same third step."""
    import os

    mine, _ = dp_slice(batch, engine)
    ckpt = f"{out_dir}/ckpt"
    engine.save_checkpoint(ckpt)
    nxt = engine.train_step(policy_loss, mine, with_entropy=True)
    after = _split(engine.full_state_dict())[0]
    other = _engine(path, dp=1, tp=2, world=world)
    other.load_checkpoint(ckpt)
    again = other.train_step(policy_loss, mine, with_entropy=True)
    errors["ckpt/next_loss"] = abs(nxt["loss"] - again["loss"])
    errors["ckpt/next_adapters"] = _diff(_split(other.full_state_dict())[0], after)
    facts["ckpt/same_lr"] = nxt["lr"] == again["lr"]
    for tag, kw in (("rank", {"lora_rank": 8}), ("alpha", {"lora_alpha": 4.0}),
                    ("targets", {"lora_target_modules": ("q_proj", "v_proj")}), ("no_lora", {"lora_rank": 0})):
        wrong = _engine(path, dp=1, tp=2, world=world, **kw)
        facts[f"ckpt/refuses_{tag}"] = _raises(lambda: wrong.load_checkpoint(ckpt), "LoRA")
    return {"bytes": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)}


@pytest.fixture(scope="module")
def spawned(model_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("lora_out")
    return run_distributed(_all, world_size=2, args=(model_path, str(out_dir)), timeout_s=240), out_dir


def test_layouts_agree_and_base_stays_frozen(spawned):
    results, _ = spawned
    worst: dict[str, float] = {}
    for r in results:
        for k, v in r["errors"].items():
            worst[k] = max(worst.get(k, 0.0), v)
    assert len([k for k in worst if k.endswith("/adapters")]) == 8, sorted(worst)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"differences above {TOL}: {bad}"
    failed = sorted(k for r in results for k, v in r["facts"].items() if not v)
    assert not failed, failed


def test_checkpoint_holds_only_adapters(spawned):
    import json

    from rlframe.workers.engines.dcp_reader import SafeFileSystemReader
    from rlframe.workers.engines.lora import is_adapter_name

    _, out_dir = spawned
    ckpt = out_dir / "ckpt"
    keys = list(SafeFileSystemReader(str(ckpt / "model_optim")).read_metadata().state_dict_metadata)
    model_keys = [k.removeprefix("model.") for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.")]
    assert model_keys and all(is_adapter_name(k) for k in model_keys), model_keys
    assert optim_keys and all(".lora_A." in k or ".lora_B." in k or k.endswith(".step") or "param_groups" in k
                              for k in optim_keys), optim_keys
    meta = json.loads((ckpt / "layout.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}


def test_export_peft_adapter_and_merged_model(spawned, model_path):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    results, out_dir = spawned
    export = out_dir / "export"
    adapter = export / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    batch = make_batch()

    def log_probs(model):
        model.config.use_cache = False
        with torch.no_grad():
            return reference_outputs(model, batch, head="lm")["log_probs"]

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    got_peft, got_merged = log_probs(peft_model), log_probs(merged)
    mask = batch["response_mask"]
    assert max_abs_diff(got_peft, got_merged, mask) < TOL
    plain = log_probs(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32))
    assert max_abs_diff(got_merged, plain, mask) > 1e-3  # the adapters changed the model
    for r in results:
        lo, hi = r["rows"]
        engine_lp = torch.from_numpy(np.asarray(r["exported"]))
        assert max_abs_diff(engine_lp, got_peft[lo:hi], mask[lo:hi]) < TOL


def test_export_critic_keeps_value_head_in_adapter(spawned, model_path):
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    from tests.workers.engines.reference import build_reference

    results, out_dir = spawned
    export = out_dir / "critic_export"
    batch = make_batch()

    def values(model):
        model.config.use_cache = False
        with torch.no_grad():
            return reference_outputs(model, batch, head="value")["values"]

    peft_model = PeftModel.from_pretrained(build_reference(model_path, head="value"), str(export / "adapter")).eval()
    merged = AutoModelForTokenClassification.from_pretrained(str(export), num_labels=1, dtype=torch.float32).eval()
    got_peft, mask = values(peft_model), batch["response_mask"]
    assert max_abs_diff(got_peft, values(merged), mask) < TOL
    for r in results:
        lo, hi = r["critic_rows"]
        assert max_abs_diff(torch.from_numpy(np.asarray(r["critic_values"])), got_peft[lo:hi], mask[lo:hi]) < TOL


def test_resharding_layout_splits_adapters_like_the_engine():
    from rlframe.resharding.layout import hf_tp_split_dim

    p = "model.layers.0."
    assert hf_tp_split_dim(p + "self_attn.q_proj.lora_B.weight") == 0  # column-parallel: B on out
    assert hf_tp_split_dim(p + "self_attn.q_proj.lora_A.weight") is None
    assert hf_tp_split_dim(p + "mlp.down_proj.lora_A.weight") == 1  # row-parallel: A on in
    assert hf_tp_split_dim(p + "mlp.down_proj.lora_B.weight") is None


def _dropout_forwards(rank, world, path):
    """A LoRA engine with dropout 0.5: after one step (lora_B nonzero), forward-only passes are
    functions of the weights (eval mode), while the training forward still drops."""
    batch = make_batch(batch_size=4, seed=3)
    out = {}
    for head in ("lm", "value"):
        engine = _engine(path, dp=1, tp=1, world=world, head=head, lora_dropout=0.5, lr=5e-2)
        loss = policy_loss if head == "lm" else value_loss
        engine.train_step(loss, batch, with_entropy=head == "lm")
        forward = (lambda: engine.forward_log_probs(batch)["log_probs"]) if head == "lm" else \
            (lambda: engine.forward_values(batch))
        out[head] = [forward().numpy() for _ in range(2)]
        out[f"{head}_training"] = all(m.training for m in engine.model.modules())
    return out


def test_lora_dropout_is_off_in_forward_only_passes(model_path):
    (res,) = run_distributed(_dropout_forwards, world_size=1, args=(model_path,), timeout_s=120)
    for head in ("lm", "value"):
        first, second = res[head]
        assert np.array_equal(first, second), f"{head}: forward-only passes differ by dropout masks"
        assert res[f"{head}_training"], f"{head}: the engine must stay in train mode for its updates"
