"""`python -m rlframe.main`'s arguments: Hydra's own flags (--cfg job|hydra|all, --resolve, --info, --help)
answered as a Hydra application answers them, options anywhere among the overrides; nothing starts."""

from __future__ import annotations

import pytest
import yaml

from rlframe.main import main


@pytest.fixture
def nothing_starts(monkeypatch):
    """The job itself (planning, validation, Ray) must not run."""
    def refuse(*a, **k):
        raise AssertionError("the job started")

    monkeypatch.setattr("rlframe.plan.command.planned_config", refuse)


def test_cfg_job_prints_the_composed_config_and_exits_0(nothing_starts, capsys):
    assert main(["actor.lr=3e-5", "--cfg", "job", "-cn", "grpo_tiny", "algorithm=dapo"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["algorithm"]["name"] == "dapo" and cfg["actor"]["lr"] == 3e-5
    assert "hydra" not in cfg


def test_resolve_resolves_interpolations_in_what_cfg_prints(nothing_starts, tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - grpo_tiny\n  - _self_\nmy_lr: ${actor.lr}\n")
    assert main(["-cp", str(tmp_path), "-cn", "mine", "--cfg", "job", "actor.lr=2e-5"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["my_lr"] == "${actor.lr}"
    assert main(["-cp", str(tmp_path), "-cn", "mine", "--cfg", "job", "--resolve", "actor.lr=2e-5"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["my_lr"] == 2e-5


def test_cfg_hydra_and_all(nothing_starts, capsys):
    assert main(["--cfg", "hydra"]) == 0
    out = capsys.readouterr().out
    hydra_only = yaml.safe_load(out)
    assert list(hydra_only) == ["hydra"] and "searchpath" in hydra_only["hydra"]
    assert "only hydra.searchpath applies" in out  # what of it means anything here
    assert main(["--cfg", "all", "--resolve"]) == 0
    everything = yaml.safe_load(capsys.readouterr().out)
    assert {"actor", "trainer", "hydra"} <= set(everything)


def test_info_prints_search_path_defaults_and_config(nothing_starts, capsys):
    assert main(["--info", "-cn", "grpo_tiny", "algorithm=dapo"]) == 0
    out = capsys.readouterr().out
    assert "Config search path" in out and "configs" in out
    defaults = out.split("Defaults list")[1].split("Config:")[0]
    assert "algorithm/dapo" in defaults and "ppo_tiny" in defaults
    assert "Config group algorithm (algorithm=NAME): dapo" in out
    assert yaml.safe_load(out.split("Config:\n")[1])["algorithm"]["name"] == "dapo"
    assert main(["--info", "defaults"]) == 0
    out = capsys.readouterr().out
    assert "Defaults list" in out and "Config search path" not in out
    with pytest.raises(SystemExit) as exc:
        main(["--info", "nonsense"])
    assert exc.value.code == 2


def test_help_names_hydras_flags_and_the_config_groups(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--cfg {job,hydra,all}", "--resolve", "--info", "--config-name"))
    assert "Config group algorithm (algorithm=NAME): " in out and "grpo_tiny" in out


def test_a_config_error_exits_2(nothing_starts, capsys):
    assert main(["--cfg", "job", "-cn", "grpo_tyni"]) == 2
    assert "available: " in capsys.readouterr().err
