"""The three plugins of examples/plugins, each one file outside the package plus a config line: an
estimator that needs a critic, a training engine (plain data parallelism) and a rollout backend (a
batched torch sampler). Each is checked against an independent reference, then all three run
together in one training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlframe.config import load_config, validate
from rlframe.utils.spawn import run_distributed
from tests.workers.engines.reference import compare_forward_and_step, dp_slice, make_batch, max_abs_diff, single_process

PLUGINS = ["examples.plugins.value_baseline", "examples.plugins.ddp_engine", "examples.plugins.torch_sampler"]
TOL = 1e-5
HP = dict(lr=1e-3, weight_decay=0.1, eps=1e-6, grad_clip=1.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from rlframe.data.tiny_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("plugin_model") / "m", preset="test", seed=0))


# ---- the estimator ------------------------------------------------------------------------------
def test_value_baseline_is_return_to_go_minus_values():
    import examples.plugins.value_baseline  # noqa: F401  (registers)
    from rlframe.algos import get_advantage_estimator
    from rlframe.algos.registry import estimator_spec

    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 9.0], [0.1, 0.3, 9.0, 9.0]])
    adv, ret = get_advantage_estimator("reinforce_value_baseline")(
        token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.5)
    # G_t by hand: row 0 [0.25, 0.5, 1.0], row 1 [0.5, 0.0]; zero outside the response
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.05, 0.1, 0.4, 0.0], [0.4, -0.3, 0.0, 0.0]]))
    assert estimator_spec("reinforce_value_baseline").needs_critic
    with pytest.raises(ValueError, match="subtracts the critic's values"):
        get_advantage_estimator("reinforce_value_baseline")(token_level_rewards=rewards, response_mask=mask)


def test_plugins_are_one_config_line_each():
    """Named by `imports`, each plugin is a choice validation accepts; the estimator's trait gives the run
    a critic, the engine's spec refuses a layout it cannot hold, before any worker starts."""
    cfg = validate(load_config("grpo_tiny", [f"imports=[{','.join(PLUGINS)}]", "algorithm.name=reinforce_value_baseline",
                                             "algorithm.adv_estimator=reinforce_value_baseline", "actor.strategy=ddp",
                                             "critic.strategy=ddp", "rollout.backend=torch_sampler"]))
    assert cfg.uses_critic
    from rlframe.config import ConfigError

    with pytest.raises(ConfigError, match="ddp"):
        validate(load_config("grpo_tiny", [f"imports=[{PLUGINS[1]}]", "actor.strategy=ddp", "actor.tp=2"]))


# ---- the training engine ------------------------------------------------------------------------
def _ddp_ranks(rank, world, path, ckpt_dir):
    """Rank-local checks of the ddp engine at dp=2 against the one-process reference, then a checkpoint
    it writes loaded into the fsdp engine (and stepped on by both)."""
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    import examples.plugins.ddp_engine  # noqa: F401

    batch = make_batch()
    errors: dict[str, float] = {}
    for head in ("lm", "value"):
        ref = single_process(path, head, batch, **HP)
        # a token budget gives the two ranks different micro-batch counts
        engine = get_train_engine("ddp")(TrainEngineConfig(model_path=path, head=head, dp=2, max_tokens_per_micro_batch=20, **HP))
        layout = engine.resharding_layout()
        for name, (shape, box, local) in engine.local_shards().items():
            assert box == layout.box(name, shape, rank), (name, box)
            errors[f"{head}/shard/{name}"] = max_abs_diff(local, ref["init"][name])
        mine, rows = dp_slice(batch, engine)
        compare_forward_and_step(engine, mine, rows, ref, errors, f"ddp/{head}", head=head)
    # `engine` is the critic after one step: its DCP checkpoint loads into an fsdp engine of dp=2
    engine.save_checkpoint(ckpt_dir)
    fsdp = get_train_engine("fsdp")(TrainEngineConfig(model_path=path, head="value", dp=2, **HP))
    fsdp.load_checkpoint(ckpt_dir)
    a, b = engine.full_state_dict(), fsdp.full_state_dict()
    errors["ckpt/loaded_weights"] = max(max_abs_diff(a[k], b[k]) for k in a)
    from tests.workers.engines.reference import value_loss

    mine, _ = dp_slice(make_batch(seed=1), engine)
    m_ddp, m_fsdp = engine.train_step(value_loss, mine), fsdp.train_step(value_loss, mine)
    errors["ckpt/next_loss"] = abs(m_ddp["loss"] - m_fsdp["loss"])
    errors["ckpt/next_grad_norm"] = abs(m_ddp["grad_norm"] - m_fsdp["grad_norm"])
    a, b = engine.full_state_dict(), fsdp.full_state_dict()
    errors["ckpt/next_weights"] = max(max_abs_diff(a[k], b[k]) for k in a)  # the AdamW moments came along
    meta = json.loads((Path(ckpt_dir) / "layout.json").read_text())
    return errors, meta["backend"]


def test_ddp_engine_equals_one_process_and_shares_checkpoints_with_fsdp(model_path, tmp_path):
    results = run_distributed(_ddp_ranks, world_size=2, args=(model_path, str(tmp_path / "ckpt")))
    for errors, backend in results:
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, bad
        assert backend == "ddp"


# ---- the rollout backend ------------------------------------------------------------------------
def _sampler(model_path, backend="torch_sampler", **kw):
    import examples.plugins.torch_sampler  # noqa: F401
    from rlframe.workers.rollout import RolloutConfig, build_rollout_engine

    return build_rollout_engine(model_path, config=RolloutConfig(backend=backend, dtype="float32", **kw))


def _prompts(rows: int, seed0: int = 100):
    g = torch.Generator().manual_seed(0)
    lens = [5, 3, 4, 2, 5][:rows]
    ids = torch.zeros(rows, 5, dtype=torch.long)
    mask = torch.zeros(rows, 5, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, 5 - n:] = torch.randint(4, 40, (n,), generator=g)
        mask[b, 5 - n:] = 1
    return {"input_ids": ids, "attention_mask": mask, "seed": torch.arange(rows) * 7 + seed0}


def test_torch_sampler_samples_do_not_depend_on_their_batch(model_path):
    from rlframe.workers.rollout import SamplingConfig

    engine = _sampler(model_path)
    sampling = SamplingConfig(n=2, temperature=1.3, top_p=0.9, max_new_tokens=8, ignore_eos=True)
    together = engine.generate(_prompts(4), sampling).batch
    alone = engine.generate({k: v[2:3] for k, v in _prompts(4).items()}, sampling).batch
    assert torch.equal(together["responses"][4:6], alone["responses"])
    torch.testing.assert_close(together["rollout_log_probs"][4:6], alone["rollout_log_probs"], atol=1e-5, rtol=0)
    # n samples of a row differ (own generators), and other seeds give other samples
    assert not torch.equal(together["responses"][4], together["responses"][5])
    other = engine.generate({**_prompts(4), "seed": _prompts(4)["seed"] + 1000}, sampling).batch
    assert not torch.equal(other["responses"], together["responses"])


def test_torch_sampler_log_probs_are_the_trainers(model_path):
    """Processed log-probs at temperature T equal a teacher-forced forward's log_softmax(logits / T) of
    the sampled tokens (no top-k/top-p), as the actor computes them; raw mode those at T=1."""
    from transformers import AutoModelForCausalLM

    from rlframe.workers.rollout import SamplingConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for mode, temperature in (("processed", 0.7), ("raw", 1.6)):
        out = _sampler(model_path, logprobs_mode=mode).generate(
            _prompts(3), SamplingConfig(temperature=temperature, max_new_tokens=6, ignore_eos=True)).batch
        with torch.no_grad():
            logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                           position_ids=out["position_ids"]).logits.float()
        r, t = out["responses"].shape[1], out["input_ids"].shape[1]
        scale = temperature if mode == "processed" else 1.0
        expect = torch.log_softmax(logits[:, t - r - 1:t - 1] / scale, -1).gather(-1, out["responses"][..., None])[..., 0]
        m = out["response_mask"].bool()
        assert m.all()
        torch.testing.assert_close(out["rollout_log_probs"][m], expect[m], atol=1e-4, rtol=0)


def test_torch_sampler_greedy_top_k_and_stops_match_transformers(model_path):
    from rlframe.workers.rollout import SamplingConfig

    prompts = {k: v for k, v in _prompts(3).items() if k != "seed"}
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    ours = _sampler(model_path).generate(prompts, greedy).batch
    theirs = _sampler(model_path, backend="hf").generate(prompts, greedy).batch
    assert torch.equal(ours["responses"], theirs["responses"])
    top1 = _sampler(model_path).generate(prompts, SamplingConfig(temperature=0.8, top_k=1, max_new_tokens=6,
                                                                 ignore_eos=True)).batch
    assert torch.equal(top1["responses"], ours["responses"])
    # a stop id ends a sample after it (included), the rest masked
    stop = int(ours["responses"][0, 2])
    cut = _sampler(model_path).generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True,
                                                                stop_token_ids=(stop,))).batch
    first = int((ours["responses"][0] == stop).nonzero()[0])
    assert cut["response_mask"][0].sum() == first + 1 and cut["responses"][0, first] == stop


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    from examples.plugins.torch_sampler import filtered_logits
    from rlframe.workers.rollout import SamplingConfig

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: torch.isfinite(filtered_logits(logits, SamplingConfig(top_p=p))).tolist()[0]  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.7) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert kept(1.0) == [True] * 4


# ---- all three in one run -----------------------------------------------------------------------
@pytest.mark.slow
def test_three_plugins_train_together(tmp_path, ray_cluster):
    """A REINFORCE-with-baseline run whose actor and critic are ddp engines of dp=2 and whose rollout is the
    torch sampler on 2 replicas, at temperature 0.9, with two mini-batches a step."""
    from rlframe.controller.run import run_training
    from tests.controller.trainers.test_end_to_end import COMMON

    cfg = validate(load_config("grpo_tiny", COMMON + [
        f"imports=[{','.join(PLUGINS)}]", "algorithm.name=reinforce_value_baseline",
        "algorithm.adv_estimator=reinforce_value_baseline", "actor.strategy=ddp", "critic.strategy=ddp",
        "rollout.backend=torch_sampler", "actor.dp=2", "critic.dp=2", "rollout.temperature=0.9",
        "actor.mini_batch_size=8", "critic.mini_batch_size=8", "actor.micro_batch_size=4", "critic.micro_batch_size=4",
        "trainer.save_every=2", f"trainer.output_dir={tmp_path}"]))
    summary = run_training(cfg, config_name="grpo_tiny")
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] >= 1 and "actor/pg_loss" in r]
    assert len(train) == 2
    for r in train:
        assert r["critic/vf_loss"] > 0 and "actor/grad_norm" in r  # the critic the estimator asked for trained
    layout = json.loads(next(run_dir.glob("**/actor/layout.json")).read_text())
    assert layout["backend"] == "ddp"
