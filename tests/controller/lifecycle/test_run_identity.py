"""Run identity on real directories: a run directory belongs to one run, every checkpoint records the
run that wrote it (and its config), resume=auto and retention see only this run's checkpoints, a
resume says what changed, and the KL controllers keep what the user set."""

import json

import pytest

from rlframe.algos.kl import AdaptiveKLController, FixedKLController
from rlframe.config import load_config
from rlframe.controller.lifecycle.checkpoint import CheckpointManager
from rlframe.controller.lifecycle.run_identity import (
    RUN_FILE, RunDirConflict, claim_run, config_dict, read_run_record, resume_changes,
)
from tests.controller.lifecycle.test_checkpoint import role_writer


def cfg(*overrides):
    return load_config("ppo_tiny", list(overrides))


def manager(run_dir, config, *, keep):
    mgr = CheckpointManager(run_dir, keep=keep)
    mgr.bind(claim_run(run_dir, config, announce=lambda _: None), config=config_dict(config))
    return mgr


def save(mgr, step):
    return mgr.save(step, save_roles=role_writer(), state={"dataloader": {"pos": step}})


def test_first_launch_records_the_run_and_checkpoints_record_it_with_the_config(tmp_path):
    config = cfg("actor.lr=3e-4")
    mgr = manager(tmp_path, config, keep=2)
    record = read_run_record(tmp_path)
    assert record is not None and record.identity["algorithm.name"] == "ppo"
    assert claim_run(tmp_path, config).run_id == record.run_id  # the same run on every later launch
    info = json.loads((save(mgr, 1) / RUN_FILE).read_text())
    assert info["run_id"] == record.run_id and info["identity"] == record.identity
    assert info["config"]["actor"]["lr"] == 3e-4


@pytest.mark.parametrize("resume", ["auto", "off"])
def test_a_directory_of_another_run_is_refused_naming_the_keys_and_the_ways_out(tmp_path, resume):
    save(manager(tmp_path, cfg(), keep=2), 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(RunDirConflict) as err:
        claim_run(tmp_path, cfg("trainer.seed=1", "algorithm.adv_estimator=grpo", f"trainer.resume={resume}"))
    said = str(err.value)
    assert "trainer.seed: 0 there, 1 here" in said and "algorithm.adv_estimator: 'gae' there, 'grpo' here" in said
    assert str(tmp_path) in said and "trainer.experiment" in said and "trainer.resume=off does not change that" in said
    assert "metrics.jsonl" in said and "checkpoints/" in said
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing touched


def test_run_json_gone_the_checkpoints_say_whose_directory_it_is(tmp_path):
    mgr = manager(tmp_path, cfg(), keep=2)
    save(mgr, 1)
    run_id = mgr.run.run_id
    (tmp_path / RUN_FILE).unlink()
    with pytest.raises(RunDirConflict, match="which wrote step_000001"):
        claim_run(tmp_path, cfg("data.seed=5"))
    assert claim_run(tmp_path, cfg(), announce=lambda _: None).run_id == run_id


def test_a_legacy_directory_is_adopted_when_its_config_matches(tmp_path):
    import yaml

    from rlframe.config.build import to_dict

    legacy = CheckpointManager(tmp_path, keep=3)  # written before checkpoints recorded their run
    save(legacy, 1)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"config_name": "ppo_tiny", **to_dict(cfg())}))
    with pytest.raises(RunDirConflict, match="model.tiny_preset: 'demo' there, 'small' here"):
        claim_run(tmp_path, cfg("model.tiny_preset=small"))
    said = []
    mgr = manager(tmp_path, cfg(), keep=3)
    record = claim_run(tmp_path, cfg(), announce=said.append)
    assert record.adopted == ["step_000001"] and said == []  # adopted once, then an ordinary run
    assert [p.name for _, p in mgr.complete()] == ["step_000001"]


def test_an_empty_or_foreign_free_directory_starts_a_new_run(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-step_000003").mkdir(parents=True)  # a crashed save leaves no run's files
    (tmp_path / "notes.txt").write_text("mine")
    assert claim_run(tmp_path, cfg(), announce=lambda _: None).run_id


def test_retention_and_resume_auto_see_only_this_runs_checkpoints(tmp_path):
    """Another run's checkpoints (same settings, another run id: copied in) with higher step numbers:
    this run's retention keeps its own newest and deletes only its own; resume=auto picks its own."""
    ours = manager(tmp_path, cfg(), keep=1)
    theirs = CheckpointManager(tmp_path, keep=5)
    other_run = claim_run(tmp_path / "elsewhere", cfg(), announce=lambda _: None)
    theirs.bind(other_run, config=config_dict(cfg()))
    save(theirs, 10), save(theirs, 20)
    for step in (1, 2, 3):
        save(ours, step)
    names = sorted(p.name for _, p in ours.all_complete())
    assert names == ["step_000003", "step_000010", "step_000020"], names
    assert ours.resolve("auto").name == "step_000003"
    with pytest.raises(RunDirConflict, match="step_000010 was written by another run"):
        save(ours, 10)  # never overwritten either
    assert (tmp_path / "checkpoints" / "step_000010" / RUN_FILE).is_file()
    assert json.loads((tmp_path / "checkpoints" / "step_000010" / RUN_FILE).read_text())["run_id"] == other_run.run_id


def test_resume_off_starts_this_run_over_and_its_earlier_checkpoints_are_superseded(tmp_path):
    """The same run launched with trainer.resume=off: resume=auto never goes back to the earlier start's
    (higher-numbered) checkpoints, and retention deletes them once the new start has one that verifies."""
    first = manager(tmp_path, cfg(), keep=2)
    for step in (4, 6):
        save(first, step)
    said = []
    record = claim_run(tmp_path, cfg("trainer.resume=off"), announce=said.append)
    assert record.run_id == first.run.run_id and record.attempt == 2 and "starting run" in said[0]
    assert claim_run(tmp_path, cfg("trainer.resume=off")).attempt == 2  # the trainer's own claim: no new start
    again = CheckpointManager(tmp_path, keep=2)
    again.bind(record, config=config_dict(cfg()))
    assert again.resolve("auto") is None  # not the earlier start's step 6
    save(again, 2)
    assert [p.name for _, p in again.all_complete()] == ["step_000002"]
    save(again, 4)  # the same run's: may be replaced
    assert again.resolve("auto").name == "step_000004"


def test_checkpoints_of_other_settings_in_the_directory_refuse_the_start(tmp_path):
    manager(tmp_path, cfg(), keep=2)
    stranger = CheckpointManager(tmp_path, keep=2)
    stranger.bind(claim_run(tmp_path / "b", cfg("trainer.seed=9"), announce=lambda _: None), config={})
    save(stranger, 4)
    with pytest.raises(RunDirConflict, match=r"(?s)holds checkpoints of another run \(step_000004 written by run "
                                              r".*trainer.seed: 9 there, 0 here"):
        claim_run(tmp_path, cfg())


def test_resume_says_one_line_per_changed_setting(tmp_path):
    mgr = manager(tmp_path, cfg("algorithm.kl_in_reward=true"), keep=2)
    path = save(mgr, 1)
    lines = resume_changes(mgr.run_info(path), cfg("algorithm.kl_in_reward=true", "actor.lr=5e-5",
                                                   "algorithm.kl_coef=0.01", "trainer.total_steps=99",
                                                   "trainer.resume=auto"), checkpoint=path)
    assert len(lines) == 3, lines
    assert lines[0].startswith("resume: actor.lr changed since step_000001: 0.0001 -> 5e-05; the config's value")
    assert "algorithm.kl_coef changed since step_000001: 0.001 -> 0.01; fixed coefficient" in lines[1]
    assert "trainer.total_steps" in lines[2] and "ends at step 99" in lines[2]
    adaptive = resume_changes(mgr.run_info(path), cfg("algorithm.kl_in_reward=true", "algorithm.kl_target=6",
                                                      "algorithm.kl_coef=0.2"), checkpoint=path)
    assert any("kl_target" in line and "restarts from algorithm.kl_coef=0.2" in line for line in adaptive), adaptive


def test_resume_names_only_kl_keys_that_act(tmp_path):
    """A GRPO run (KL in the loss, none in the reward): a changed algorithm.kl_coef has no effect there, so
    the resume does not report it as applied; the loss's coefficient, which acts, is named."""
    mgr = manager(tmp_path, cfg("algorithm=grpo"), keep=2)
    path = save(mgr, 1)
    lines = resume_changes(mgr.run_info(path), cfg("algorithm=grpo", "algorithm.kl_coef=0.05",
                                                   "algorithm.kl_estimator=k3", "algorithm.kl_loss_coef=0.01"),
                           checkpoint=path)
    assert [line.split(" changed")[0] for line in lines] == ["resume: algorithm.kl_loss_coef"], lines
    assert "0.001 -> 0.01; the config's value applies" in lines[0]
    # the same keys in a run with KL in the reward (and none in the loss): the reward's keys are named
    ppo = tmp_path / "ppo"
    mgr = manager(ppo, cfg("algorithm.kl_in_reward=true"), keep=2)
    path = save(mgr, 1)
    lines = resume_changes(mgr.run_info(path), cfg("algorithm.kl_in_reward=true", "algorithm.kl_coef=0.05",
                                                   "algorithm.kl_loss_coef=0.01"), checkpoint=path)
    assert [line.split(" changed")[0] for line in lines] == ["resume: algorithm.kl_coef"], lines


def test_kl_controllers_keep_what_the_user_set():
    fixed = FixedKLController(kl_coef=0.01)
    fixed.load_state_dict(FixedKLController(kl_coef=0.001).state_dict())
    assert fixed.value == 0.01  # a fixed coefficient is a setting: the config's applies
    moved = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=100)
    moved.update(current_kl=12.0, n_steps=10)
    same_target = AdaptiveKLController(init_kl_coef=0.5, target_kl=6.0, horizon=50)
    same_target.load_state_dict(moved.state_dict())
    assert same_target.value == moved.value  # its state continues
    new_target = AdaptiveKLController(init_kl_coef=0.5, target_kl=3.0, horizon=100)
    new_target.load_state_dict(moved.state_dict())
    assert new_target.value == 0.5  # restarts from the configured coefficient
    from_fixed = AdaptiveKLController(init_kl_coef=0.5, target_kl=3.0, horizon=100)
    from_fixed.load_state_dict(FixedKLController(kl_coef=0.001).state_dict())
    assert from_fixed.value == 0.5


def test_without_run_json_the_runs_latest_start_is_recovered(tmp_path):
    """run.json lost after trainer.resume=off started the run over: its second start saved step 10, the
    first step 60. The planner's read (current_record) and the trainer's claim agree on start 2, so
    resume=auto continues start 2 and start 1's checkpoints stay superseded."""
    from rlframe.controller.lifecycle.checkpoint import resume_checkpoint
    from rlframe.controller.lifecycle.run_identity import config_dict, current_record, identity_of
    from rlframe.utils import manifest

    cfg = load_config("ppo_tiny", [f"trainer.output_dir={tmp_path}"])
    run_dir = tmp_path / cfg.trainer.experiment
    for step, attempt in ((60, 1), (10, 2)):
        ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
        (ckpt / "run.json").write_text(json.dumps({"run_id": "r1", "attempt": attempt,
                                                   "identity": identity_of(config_dict(cfg))}))
        manifest.write_manifest(ckpt)
    assert current_record(run_dir).attempt == 2
    assert resume_checkpoint(run_dir, "auto").name == "step_000010"
    assert claim_run(run_dir, cfg, announce=lambda line: None).attempt == 2
