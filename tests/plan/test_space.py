"""The plan enumeration: every plan it builds passes the config rules, means what its overrides say,
and respects the memory estimate on GPUs."""

import dataclasses

import pytest

from rlframe.config import load_config, validate
from rlframe.plan.dry_run import model_dims
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
        assert ks == {0, cfg.trainer.max_staleness}
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


@pytest.mark.parametrize("given", [
    ["resources.procs_per_node=4"],
    # a config that already splits (its mapping must be replaced, not merged into)
    ["resources.procs_per_node=4", "resources.placement=split", "+resources.split_procs={actor: 2, ref: 2, rollout: 1}",
     "actor.micro_batch_size=null", "actor.max_tokens_per_micro_batch=64"],
])
def test_overrides_give_the_applied_config(given):
    """A plan on the command line (its overrides) is the config the planner estimated."""
    cfg = base("ppo_tiny", *given)
    plans = candidates(cfg, model_dims(cfg), max_staleness=1)
    for plan in plans[:: max(1, len(plans) // 12)]:
        composed = load_config("ppo_tiny", [*given, "trainer.dry_run=true", *plan.overrides(cfg)])
        assert dataclasses.asdict(composed) == dataclasses.asdict(plan.apply(cfg)), plan.label()


@pytest.mark.parametrize("raw", [
    {"model_type": "qwen2", "tie_word_embeddings": False},
    {"model_type": "qwen2", "tie_word_embeddings": True},
    {"model_type": "mistral", "tie_word_embeddings": False, "intermediate_size": 96},
])
def test_engine_rules_agree_with_the_engines(raw):
    """space.engine_accepts says yes exactly when the engines' own checks pass."""
    from types import SimpleNamespace

    from rlframe.plan.space import engine_accepts
    from rlframe.resharding.formats import ModelDims
    from rlframe.workers.engines.fsdp.parallelize import check_model_fits
    from rlframe.workers.engines.megatron.model import check_hf_config

    hf = SimpleNamespace(**{"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 102, **raw})
    dims = ModelDims.from_hf_config(hf)
    for tp in (1, 2, 4):
        for pp in (1, 2, 3, 4):
            def engine_ok(check) -> bool:
                try:
                    check()
                    return True
                except ValueError:
                    return False

            megatron = engine_ok(lambda: check_hf_config(hf, tp=tp, pp=pp, where="actor"))
            fsdp = pp == 1 and engine_ok(lambda: check_model_fits(hf, tp=tp, model_type_path="actor"))
            assert engine_accepts("megatron", tp, pp, dims, hf.model_type) == megatron, (raw, tp, pp)
            assert engine_accepts("fsdp", tp, pp, dims, hf.model_type) == fsdp, (raw, tp, pp)


def test_transformers_generate_has_no_tensor_parallelism():
    cfg = base("grpo_tiny", "resources.procs_per_node=4", "rollout.backend=hf")
    assert {p.values["rollout.tp"] for p in candidates(cfg, model_dims(cfg))} == {1}


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
