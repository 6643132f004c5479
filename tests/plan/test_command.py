"""`rlframe plan`: ranks the plans, and the config it writes runs as is (loads, validates, and is
the plan it printed first)."""

import dataclasses

import pytest

from rlframe.cli import main
from rlframe.config import load_config, validate
from rlframe.plan.cost import Constants
from tests.demo_leftovers import DEMO_STEP, clone_after_demo


def test_plan_writes_the_best_as_a_config(tmp_path, capsys):
    constants = tmp_path / "constants.json"
    Constants(source="test constants").save(constants)
    out = tmp_path / "cfgs" / "best.yaml"
    assert main(["plan", "--top", "3", "--constants", str(constants), "--write", str(out),
                 "resources.procs_per_node=4", "--max-staleness", "1", "algorithm.off_policy_correction=tis"]) == 0
    printed = capsys.readouterr().out
    assert "plans for ppo_tiny on 1 x 4 CPU processes; constants: test constants" in printed
    first = printed.splitlines()[printed.splitlines().index(next(l for l in printed.splitlines() if l.strip().startswith("#"))) + 1]
    cfg = validate(load_config("best", [], extra_dir=out.parent))  # runs as is: a whole config, no defaults
    assert not cfg.trainer.dry_run
    shown = first.split("  ")[-1].strip()  # the plan's label, as printed
    assert f"rollout tp{cfg.rollout.tp}" in shown and f"actor {cfg.actor.strategy} dp{cfg.actor.dp}" in shown
    base = load_config("ppo_tiny", ["resources.procs_per_node=4", "algorithm.off_policy_correction=tis"])
    same = {f.name for f in dataclasses.fields(cfg)} - {"resources", "actor", "critic", "rollout", "trainer"}
    assert all(getattr(cfg, f) == getattr(base, f) for f in same)  # only the plan's sections differ


def test_plan_without_constants_says_so(tmp_path, capsys):
    assert main(["plan", "--top", "1", "--constants", str(tmp_path / "none.json"), "-cn", "grpo_tiny"]) == 0
    assert "using defaults (run `rlframe plan --calibrate`)" in capsys.readouterr().out


def test_plan_config_error_exits_2(capsys):
    assert main(["plan", "actor.no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_plan_refuses_what_it_does_not_model(capsys):
    assert main(["plan", "-cn", "sft_tiny"]) == 2
    assert "models the PPO-family step" in capsys.readouterr().err
    assert main(["plan", "--calibrate", "resources.placement=split", "actor.dp=1", "critic.dp=1",
                 "+resources.split_procs={actor: 1, critic: 1, ref: 1, rollout: 1}"]) == 2
    assert "calibrate on a colocated synchronous config" in capsys.readouterr().err


@pytest.fixture
def after_make_demo(tmp_path_factory, monkeypatch):
    """The working directory: a copy of the repository root as `make demo` leaves it, its outputs/
    holding the demo's checkpoint (2 processes, dp2; tests/demo_leftovers.py)."""
    cwd = clone_after_demo(tmp_path_factory.mktemp("clone"))
    monkeypatch.chdir(cwd)
    return cwd


def test_auto_plan_chooses_before_the_run_starts(tmp_path, capsys, after_make_demo):
    """trainer.auto_plan=true: a config whose own layout does not fit its 4 processes runs the
    fastest plan instead (shown here by the dry run, which then describes the chosen layout). In its
    own output directory: the demo's checkpoint in the working directory's outputs/ is not its run."""
    from rlframe.main import main as run_main

    own = f"trainer.output_dir={tmp_path}"
    assert run_main(["trainer.auto_plan=true", "trainer.dry_run=true", "resources.procs_per_node=4", own]) == 0
    out = capsys.readouterr().out
    assert "rlframe: trainer.auto_plan chose " in out and "config ppo_tiny: valid" in out
    assert run_main(["trainer.auto_plan=true", "trainer.dry_run=true", "-cn", "sft_tiny", own]) == 2


def test_a_resumed_checkpoint_whose_layout_no_longer_fits_says_what_to_do(after_make_demo, capsys):
    """auto_plan keeps the layout of the checkpoint it resumes (here the demo's, dp2 on 2 processes);
    on 4 processes that layout does not fit: the refusal says that the checkpoint was written with
    another layout, and the ways on (its resources, trainer.resume=off, another run directory), not
    a bare layout error naming keys the user never set. Each way on then works."""
    from rlframe.main import main as run_main

    dry = ["trainer.auto_plan=true", "trainer.dry_run=true"]
    assert run_main([*dry, "resources.procs_per_node=4"]) == 2
    err = capsys.readouterr().err
    [problem] = [line for line in err.splitlines() if line.startswith("  - ")]
    assert f"checkpoints/{DEMO_STEP}" in problem and "was written with another layout" in problem, err
    assert "actor fsdp dp2" in problem and "on resources.nodes=1 resources.procs_per_node=2" in problem, err
    for way in ("launch it with resources.nodes=1 resources.procs_per_node=2", "trainer.resume=off",
                "trainer.experiment", "trainer.output_dir"):
        assert way in problem, (way, err)
    assert run_main([*dry, "resources.procs_per_node=2"]) == 0
    assert "keeps the plan of the checkpoint it resumes" in capsys.readouterr().out
    for fresh in ("trainer.resume=off", "trainer.experiment=another"):
        assert run_main([*dry, "resources.procs_per_node=4", fresh]) == 0, capsys.readouterr().err
        assert "rlframe: trainer.auto_plan chose " in capsys.readouterr().out


def test_a_resumed_run_keeps_its_checkpoints_plan(tmp_path, capsys):
    """auto_plan with a checkpoint to resume: the layout the checkpoint was written with, whatever
    the estimate says now (a checkpoint loads into its own layout). The checkpoint is the one the
    trainer loads (the checkpoint manager's rule): a newer one that fails verification is skipped,
    as resume=auto skips it."""
    import json

    from rlframe.config.build import to_dict
    from rlframe.controller.lifecycle.run_identity import config_dict, identity_of
    from rlframe.plan.command import auto_plan
    from rlframe.utils import manifest

    cfg = load_config("ppo_tiny", ["resources.procs_per_node=4", f"trainer.output_dir={tmp_path}",
                                   "trainer.auto_plan=true"])

    def checkpoint(step, strategy, dp, tp):
        written = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, strategy=strategy, dp=dp, tp=tp),
                                      critic=dataclasses.replace(cfg.critic, strategy=strategy, dp=dp, tp=tp))
        ckpt = tmp_path / cfg.trainer.experiment / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text("{}")
        (ckpt / "run.json").write_text(json.dumps({"run_id": "x", "identity": identity_of(config_dict(cfg)),
                                                   "config": to_dict(written)}))
        manifest.write_manifest(ckpt)
        return ckpt

    checkpoint(2, "megatron", 2, 2)
    damaged = checkpoint(4, "fsdp", 1, 4)
    (damaged / "trainer_state.json").write_text('{"step": 4}')  # no longer what its manifest says
    kept = auto_plan(cfg)
    assert (kept.actor.strategy, kept.actor.dp, kept.actor.tp) == ("megatron", 2, 2)
    assert "keeps the plan of the checkpoint it resumes" in capsys.readouterr().out
    fresh = auto_plan(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="off")))
    assert "chose" in capsys.readouterr().out and validate(fresh)


def test_auto_plan_reports_the_configs_own_problem(capsys):
    from rlframe.main import main as run_main

    assert run_main(["trainer.auto_plan=true", "trainer.dry_run=true", "algorithm.adv_estimator=gea"]) == 2
    assert "algorithm.adv_estimator" in capsys.readouterr().err
