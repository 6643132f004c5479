"""The plan enumeration: every plan it builds passes the config rules, means what its overrides say,
and respects the memory estimate on GPUs."""

import dataclasses

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.dry_run import model_dims
from rlframe.plan.space import candidates, enumerate_plans, layouts, micro_batches


def base(name, *overrides):
    return load_config(name, [*overrides, "trainer.dry_run=true"])


@pytest.mark.parametrize("name, overrides", [
    ("ppo_tiny", ["resources.procs_per_node=2"]),
    ("ppo_tiny", ["resources.procs_per_node=4", "trainer.max_staleness=1", "algorithm.off_policy_correction=tis"]),
    ("grpo_tiny", ["resources.procs_per_node=4", "model.tiny_preset=12m"]),
    ("grpo_tiny", ["resources.procs_per_node=4", "actor.lora_rank=4"]),
    ("grpo_tiny", ["resources.procs_per_node=4", "algorithm=dapo"]),
    ("grpo_qwen7b", []),
])
def test_every_plan_passes_the_config_rules(name, overrides):
    cfg = base(name, *overrides)
    space = enumerate_plans(cfg, model_dims(cfg))
    assert not space.refused, [(p.label(), probs) for p, probs in space.refused[:3]]
    assert space.plans
    labels = [p.label() for p, _ in space.plans]
    assert len(set(labels)) == len(labels), "a plan listed twice"
    if cfg.actor.lora_rank:
        assert all(c.actor.strategy == "fsdp" for _, c in space.plans)  # LoRA runs on fsdp only
    if cfg.trainer.max_staleness:
        ks = {c.trainer.max_staleness for _, c in space.plans}
        assert ks == {0, 1}
        assert all(c.resources.placement == "split" for _, c in space.plans if c.trainer.max_staleness)
    else:
        assert {c.trainer.max_staleness for _, c in space.plans} == {0}
    if cfg.resources.use_gpu:
        assert {c.resources.placement for _, c in space.plans} == {"colocated"}  # split is CPU-only today
        assert space.too_big  # the 7B model does not fit every layout on 80 GB devices


def test_dapo_never_runs_ahead():
    """Dynamic sampling generates more than one batch a step: no asynchronous plan for it."""
    cfg = base("grpo_tiny", "resources.procs_per_node=4", "algorithm=dapo")
    assert {p.values["trainer.max_staleness"] for p in candidates(cfg, model_dims(cfg), max_staleness=2)} == {0}


def test_overrides_give_the_applied_config():
    """A plan on the command line (its overrides) is the config the planner estimated."""
    cfg = base("ppo_tiny", "resources.procs_per_node=4")
    plans = candidates(cfg, model_dims(cfg), max_staleness=1)
    for plan in plans[:: max(1, len(plans) // 12)]:
        composed = load_config("ppo_tiny", ["resources.procs_per_node=4", "trainer.dry_run=true", *plan.overrides()])
        assert dataclasses.asdict(composed) == dataclasses.asdict(plan.apply(cfg)), plan.label()


def test_the_hand_written_7b_layout_is_among_the_plans():
    cfg = base("grpo_qwen7b")
    space = enumerate_plans(cfg, model_dims(cfg))
    mine = {(c.actor.strategy, c.actor.dp, c.actor.tp, c.actor.pp, c.actor.micro_batch_size, c.rollout.tp)
            for _, c in space.plans}
    a = validate(cfg).actor
    assert (a.strategy, a.dp, a.tp, a.pp, a.micro_batch_size, cfg.rollout.tp) in mine


def test_layouts_and_micro_batches_by_hand():
    dims = model_dims(base("ppo_tiny"))  # demo: 4 layers, 2 kv heads
    assert sorted(layouts(4, dims)) == sorted([
        ("fsdp", 4, 1, 1), ("fsdp", 2, 2, 1),
        ("megatron", 4, 1, 1), ("megatron", 2, 1, 2), ("megatron", 1, 1, 4), ("megatron", 2, 2, 1), ("megatron", 1, 2, 2)])
    assert layouts(4, dims, lora=True) == [("fsdp", 4, 1, 1), ("fsdp", 2, 2, 1)]
    assert micro_batches(48) == [16, 8, 4]
    assert micro_batches(12, None) == [4, 2, 1]
