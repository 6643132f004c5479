"""The commands the README and docs tell a user to type still run.

Every ```bash block in README.md, docs/*.md and examples/*/README.md is preceded (on the line before
it, blank lines allowed) by one of

    <!-- runnable -->                 the test runs every command of the block
    <!-- not runnable: WHY -->        it does not (needs a cluster, a GPU, a previous run, ...)

A block without either fails `test_every_bash_block_is_marked`. Runnable commands run in this
process, in the repository root: `python -m rlframe.main ARGS` as rlframe.main.main(ARGS), `rlframe
CMD ARGS` as rlframe.cli.main([CMD, *ARGS]), sharing the session's Ray (the `ray_cluster` fixture).
Every command gets a temporary output directory (`trainer.output_dir`), so none reads or writes the
clone's outputs/: a dry run runs otherwise as written, and in a copy of the repository root whose
outputs/ holds what `make demo` leaves there (tests/demo_leftovers.py: the README's order, demo then
tests, must not change what the docs' commands do); any other run gets SHORT appended too (one step,
no validation), and `rlframe preflight` keeps its own step count.

Exiting 0 is not enough: PROMISES maps each runnable command (as written, comments dropped) to a
check of what the text around its block says it does (exit code, lines it prints, files in its run
directory), each next to the sentence it checks; a runnable command without an entry fails
`test_every_runnable_command_has_a_promise`. The checks read the runs the test makes anyway: a
non-dry run is the short one (one step, no validation).
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
RUNNABLE = "<!-- runnable -->"
NOT_RUNNABLE = re.compile(r"<!-- not runnable: \S.* -->")
SHORT = ["trainer.total_steps=1", "trainer.val_every=0", "trainer.loggers=[jsonl]", "trainer.plot=false"]


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the ```bash line
    marker: str | None
    commands: tuple[tuple[str, ...], ...]  # argv of each command


def _commands(lines: list[str]) -> tuple[tuple[str, ...], ...]:
    text = "\n".join(lines).replace("\\\n", " ")
    return tuple(tuple(argv) for line in text.splitlines() if (argv := shlex.split(line, comments=True)))


def bash_blocks() -> list[Block]:
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```bash":
                j = i - 1
                while j >= 0 and not lines[j].strip():
                    j -= 1
                marker = lines[j].strip() if j >= 0 else None
                end = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "```")
                out.append(Block(f"{path.relative_to(ROOT)}:{i + 1}", marker, _commands(lines[i + 1:end])))
                i = end
            i += 1
    return out


BLOCKS = bash_blocks()
RUNS = [(b.where, argv) for b in BLOCKS if b.marker == RUNNABLE for argv in b.commands]
UNIQUE = list({argv: where for where, argv in reversed(RUNS)}.items())[::-1]  # one run per distinct command


def is_dry(argv) -> bool:
    return "trainer.dry_run=true" in argv


def entry(argv: tuple[str, ...]):
    """(function, its argv) that runs the command in this process."""
    if argv[:3] == ("python", "-m", "rlframe.main"):
        from rlframe.main import main

        return main, list(argv[3:])
    if argv[0] == "rlframe":
        from rlframe.cli import main

        return main, list(argv[1:])
    raise AssertionError(f"no in-process runner for {' '.join(argv)!r}; mark its block not runnable or add one here")


def run_command(argv: tuple[str, ...], out_dir: Path) -> int:
    fn, args = entry(argv)
    if not any(a.startswith("trainer.output_dir=") for a in args):
        args += [f"trainer.output_dir={out_dir}"]
    if not is_dry(argv):
        args += [] if args[:1] == ["preflight"] else SHORT
    return fn(args)


def test_every_bash_block_is_marked():
    unmarked = [b.where for b in BLOCKS if b.marker != RUNNABLE and not NOT_RUNNABLE.fullmatch(b.marker or "")]
    assert not unmarked, (f"```bash blocks without '{RUNNABLE}' or '<!-- not runnable: why -->' on the line "
                          f"before: {unmarked}")
    assert all(b.commands for b in BLOCKS), [b.where for b in BLOCKS if not b.commands]


def test_runnable_commands_have_runners():
    for where, argv in RUNS:
        entry(argv)  # raises for a command the test cannot run
    assert len(UNIQUE) >= 5, UNIQUE


# ---- what each runnable command promises: check(exit code, its stdout + stderr, the output dir) ----


def _lines(out: str, pattern: str) -> list[re.Match]:
    """The lines of `out` that match `pattern` from their start."""
    return [m for line in out.splitlines() if (m := re.match(pattern, line))]


def _one(out: str, pattern: str) -> re.Match:
    found = _lines(out, pattern)
    assert len(found) == 1, f"expected one line matching {pattern!r}, found {len(found)} in:\n{out}"
    return found[0]


def _run_files(out_dir: Path, experiment: str) -> list[dict]:
    """README "What a run leaves behind", for the short run (one step): `outputs/<experiment>/`:
    "`config.yaml` (resolved), `metrics.jsonl` (one line per step, ...), `checkpoints/step_000002/`
    (step number in six digits; ... written atomically with a manifest ...), `hf_actor/` (the final
    actor in `save_pretrained` format ...), `summary.json`". Returns the metrics rows."""
    run = out_dir / experiment
    assert (run / "config.yaml").is_file(), sorted(p.name for p in out_dir.rglob("*"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1], [r.get("step") for r in rows]
    assert (run / "checkpoints" / "step_000001" / "MANIFEST.json").is_file()
    assert {"config.json", "model.safetensors"} <= {p.name for p in (run / "hf_actor").iterdir()}
    json.loads((run / "summary.json").read_text())
    return rows


def _dry_run_report(out: str) -> dict[str, re.Match]:
    """README: a dry run "prints the placement, per-role layouts, the resharding plan (bytes each rank
    receives vs gathering full tensors) and a per-device memory estimate"."""
    m = {"placement": _one(out, r"placement: (colocated|split)\b"),
         "actor": _one(out, r"actor training: (\w+) pp=(\d+) tp=(\d+) dp=(\d+)"),
         "rollout": _one(out, r"rollout: .*generation tp=(\d+) x (\d+) replicas"),
         "resharding": _one(out, r"resharding \(.+\).*: per rank receives max ([\d.]+) GiB, mean [\d.]+ GiB; "
                                 r"gathering full tensors on every rank would receive ([\d.]+) GiB per rank"),
         "memory": _one(out, r"memory estimate per device \(GiB"),
         "critic": (_lines(out, r"critic training: (\w+) pp=(\d+) tp=(\d+) dp=(\d+)") or [None])[0]}
    rows = _lines(out, r"  \S.*\s\d+\.\d\d$")  # the memory table's rows: a name, then GiB per column
    assert len(rows) >= 2, out
    return m


def _check_llama70b_dry_run(code, out, out_dir):
    # README: "Check a cluster config anywhere, without GPUs or weights" ... "prints the placement,
    # per-role layouts, the resharding plan (bytes each rank receives vs gathering full tensors) and a
    # per-device memory estimate."
    assert code == 0
    m = _dry_run_report(out)
    assert m["critic"] is not None, "PPO's critic layout is one of the per-role layouts"
    received, full = map(float, m["resharding"].groups())
    assert 0 < received < full  # a shard to shard plan, not a gather of full tensors


def _check_split_dry_run(code, out, out_dir):
    # placement.md: the split job "starts 4 processes: one per group (actor, vLLM, critic, reference).
    # The dry run prints the groups without starting any" (test_dry_run_command: Ray cannot be imported).
    assert code == 0
    assert _dry_run_report(out)["placement"].group(1) == "split"
    m = _one(out, r"placement: split, (\d+) CPU process\(es\) in all .*group sizes (\{.*\})$")
    assert int(m.group(1)) == 4
    assert ast.literal_eval(m.group(2)) == {"actor": 1, "rollout": 1, "critic": 1, "ref": 1}


def _check_auto_plan_dry_run(code, out, out_dir):
    # plan.md: "`trainer.auto_plan=true` makes the main job ... do the same before it starts: the fastest
    # plan replaces the config's placement and layouts (so the layout written in the config need not fit
    # its processes), and the choice is printed with the constants it used."
    assert code == 0
    chose = _one(out, r"rlframe: trainer\.auto_plan chose (colocated|split): (.+?), estimated [\d.]+ s per step, "
                      r"fastest of (\d+) plans \((defaults, not calibrated|calibrated |assumed )")
    placement, label, n_plans = chose.group(1), chose.group(2), int(chose.group(3))
    assert n_plans > 1
    report = _dry_run_report(out)
    assert report["placement"].group(1) == placement
    strategy, dp, tp, pp = re.search(r"actor (\w+) dp(\d+) tp(\d+) pp(\d+)", label).groups()
    assert report["actor"].groups() == (strategy, pp, tp, dp), (label, report["actor"].group(0))
    if placement == "colocated":  # ppo_tiny's own actor.dp=2 does not fill resources.procs_per_node=4
        assert int(dp) * int(tp) * int(pp) == 4, label
        assert _one(out, r"placement: colocated on (\d+) node\(s\) x (\d+) CPU").groups() == ("1", "4")
    else:
        assert int(_one(out, r"placement: split, (\d+) CPU process\(es\) in all").group(1)) == 4


def _plan_table(out: str, config: str, top: int) -> tuple[int, list[re.Match]]:
    """plan.md: "`rlframe plan` enumerates the plans a config could use on its cluster, estimates one
    step of each, and prints the fastest": a header, then `top` plans, fastest first, each a colocated
    one "with dp x tp x pp equal to the processes". Returns (processes, the plan rows)."""
    head = _one(out, r"(\d+) plans for (\S+) on (\d+) x (\d+) (CPU|GPU) processes; constants: \S")
    assert head.group(2) == config and int(head.group(1)) >= top, head.group(0)
    procs = int(head.group(3)) * int(head.group(4))
    rows = _lines(out, r"\s+(\d+)\s+([\d.]+)\s.*\s(colocated|split): (.+)$")
    assert [int(r.group(1)) for r in rows] == list(range(1, top + 1)), out
    steps = [float(r.group(2)) for r in rows]
    assert steps == sorted(steps), steps
    for r in rows:
        if r.group(3) == "colocated":
            dp, tp, pp = map(int, re.search(r"actor \w+ dp(\d+) tp(\d+) pp(\d+)", r.group(4)).groups())
            assert dp * tp * pp == procs, r.group(0)
    return procs, rows


def _check_plan_top5(code, out, out_dir):
    # plan.md: "prints the fastest" (`--top 5`: five of them); "Exit 0, or 2 for a config error" (rlframe plan --help)
    assert code == 0
    assert _plan_table(out, "ppo_tiny", 5)[0] == 2  # ppo_tiny: 1 node x 2 processes (README: "Ray starts two worker processes")


def _check_plan_qwen7b_top3(code, out, out_dir):
    # plan.md: "on GPUs ... the dry run's memory estimate ... drops the plans whose devices would not hold them"
    assert code == 0
    _plan_table(out, "grpo_qwen7b", 3)
    assert int(_one(out, r"\s+(\d+) more do not fit the devices").group(1)) > 0
    # plan.md: "`--constants h100-assumed` gives datasheet figures with stated" assumptions: the header says so
    assert "constants: assumed H100 SXM figures, not measured" in out


def _preflight_checks(code, out, out_dir, *, steps: int) -> dict[int, list[str]]:
    """preflight.md: "Exit code 0: every check held ... Per step it prints one line per check with the
    measured value and its limit"; it runs "for two steps" (or `--steps`) and "nothing is saved".
    Returns the names of the checks printed per step."""
    assert code == 0
    head = _one(out, r"preflight \S+: (\d+) checks, (\d+) failed$")
    # "value (limit L)", or for the duplicates' chance, a floor: "chance value (must be >= L)"
    rows = _lines(out, r"  (ok  |FAIL) step (\d+) (.+?): (?:chance )?(\S+) \((?:limit|must be >=) (\S+)\)")
    assert int(head.group(1)) == len(rows) > 0 and head.group(2) == "0", out
    assert all(r.group(1) == "ok  " for r in rows)
    per_step: dict[int, list[str]] = {}
    for r in rows:
        value, limit = float(r.group(4)), float(r.group(5))  # a measured value and its limit
        assert value == value and limit == limit, r.group(0)
        per_step.setdefault(int(r.group(2)), []).append(r.group(3))
    assert sorted(per_step) == list(range(1, steps + 1)), sorted(per_step)
    assert not any(out_dir.iterdir()), "preflight saved files in trainer.output_dir"
    return per_step


def _has(names: list[str], prefix: str) -> bool:
    return any(n.startswith(prefix) for n in names)


def _check_preflight_grpo(code, out, out_dir):
    # README: "runs it for two steps at its real layout and checks ...: the training engine's log-probs of
    # the sampled tokens equal the rollout engine's, the first mini-batch's ratio is 1, the actor equals the
    # reference at step 1, samples of a group are independent draws, the rollout engine holds exactly the
    # trainer's weights after a sync (checksums), group advantages have zero mean, the reward repeats
    # itself, no response continues past its end" (multi-turn: an agent loop only, none here).
    # preflight.md's table: "rollout vs the run's old log-probs" when it computes them ("more than one
    # mini-batch or epoch": actor.ppo_epochs=2); duplicates "per step and summed over the run".
    per_step = _preflight_checks(code, out, out_dir, steps=2)
    every_step = ["rollout vs training engine log-prob gap (mean)", "rollout vs training engine log-prob gap (max)",
                  "rollout vs the run's old log-prob gap", "first mini-batch ppo_kl", "first mini-batch clip fraction",
                  "duplicate samples in a group (", "group advantages zero-mean (grpo)", "reward function repeats its score",
                  "no policy token after an end-of-sequence id", "rollout weights equal the trainer's after a sync"]
    for step, names in per_step.items():
        assert all(_has(names, p) for p in every_step), (step, [p for p in every_step if not _has(names, p)])
    assert _has(per_step[1], "actor vs reference at step 1")
    assert _has(per_step[2], "duplicate samples in a group over 2 steps")


def _check_preflight_lora(code, out, out_dir):
    # preflight.md: `--steps 3`; the first mini-batch check is "skipped with LoRA dropout (the update's own
    # forward drops by design)"; group advantages only "for grpo, dr_grpo, rloo, lite_ppo" (ppo_tiny: gae);
    # actor vs reference at step 1 catches "LoRA adapters on in the reference"; the weight checksum
    # compares "(LoRA adapters: base weights only)".
    per_step = _preflight_checks(code, out, out_dir, steps=3)
    every_step = ["rollout vs training engine log-prob gap (mean)", "rollout vs training engine log-prob gap (max)",
                  "reward function repeats its score", "no policy token after an end-of-sequence id",
                  "rollout weights equal the trainer's after a sync"]
    for step, names in per_step.items():
        assert all(_has(names, p) for p in every_step), (step, [p for p in every_step if not _has(names, p)])
        assert not _has(names, "first mini-batch") and not _has(names, "group advantages"), names
    assert _has(per_step[1], "actor vs reference at step 1")


def _check_rft(code, out, out_dir):
    # adding_an_algorithm.md: the RFTTrainer's dataflow ("self.roles.actor.response_nll(batch)  # the new
    # worker method"), the weighted_nll loss returning {"accepted_tokens": ...}; "Everything else (the
    # hybrid engine's weight resharding before each generation, checkpoints ..., metrics, the HF export)
    # comes from the base trainer" (validation: not in the short run).
    assert code == 0
    row = _run_files(out_dir, "rft_tiny")[0]  # trainer.experiment: rft_tiny (rft_tiny.yaml)
    for name in ("rft/accept_ratio", "timing_s/response_nll", "actor/accepted_tokens", "reshard/bytes_received_mb"):
        assert name in row, name


def _check_own_data(code, out, out_dir):
    # data.md: "`examples/own_data/` does all three at once (200 prompts, a reward returning extra metrics,
    # the shipped tiny model)". examples/own_data/README.md: "GRPO on 200 prompts of your own (`train.jsonl`),
    # validated on 40 others (`val.jsonl`)"; "the run directory is `outputs/own_data/` (`metrics.jsonl` holds
    # `reward/exact/mean`, `reward/off_by/mean`, ... from the dict `reward.py` returns" ("24 steps": the
    # short run makes one, and without validation, so no `val/accuracy`).
    assert code == 0
    _one(out, r"\[rlframe\] data: 200 train prompts, 40 held out$")
    _one(out, r"\[rlframe\] model: model\.path is null, so the run starts from the tiny ")
    row = _run_files(out_dir, "own_data")[0]
    assert "reward/exact/mean" in row and "reward/off_by/mean" in row, sorted(row)
    import yaml

    assert yaml.safe_load((out_dir / "own_data" / "config.yaml").read_text())["algorithm"]["name"] == "grpo"


def _check_stream(code, out, out_dir):
    # async.md, "Streaming on the series task": `data.task=series` with "200 held-out problems", "two roles,
    # so the split layout is one process each on 2 cores"; streaming "Logged: `stream/gen_tokens`,
    # `stream/gen_busy_s` and `stream/gen_idle_s` ..., `stream/push_s`, `stream/pool_groups`,
    # `stream/generating_groups`, `stream/segments_mean` ..., `stream/versions_mixed_frac` ...,
    # `timing_s/wait_for_rollout`, and the `async/` staleness metrics"; "no sample is staler than k"
    # (k=2); the correction (`tis`) logs "`async/is_weight_mean`, `async/is_weight_max`, and what a
    # correction truncated" (`async/is_clipped_frac`: "truncating methods").
    assert code == 0
    _one(out, r"\[rlframe\] data: \d+ train prompts, 200 held out$")
    _one(out, r"\[rlframe\] starting worker groups \(split, 2 processes\): .* in its own 1 process\(es\)$")
    row = _run_files(out_dir, "grpo_series")[0]  # trainer.experiment: grpo_series (configs/grpo_series.yaml)
    logged = ["stream/gen_tokens", "stream/gen_busy_s", "stream/gen_idle_s", "stream/push_s", "stream/pool_groups",
              "stream/generating_groups", "stream/segments_mean", "stream/versions_mixed_frac",
              "timing_s/wait_for_rollout", "async/staleness", "async/policy_version",
              "async/is_weight_mean", "async/is_weight_max", "async/is_clipped_frac"]
    assert not [n for n in logged if n not in row], [n for n in logged if n not in row]
    assert 0 <= row["async/staleness"] <= 2


def _check_megatron(code, out, out_dir):
    # megatron.md: "`actor.strategy=megatron` / `critic.strategy=megatron` ... run the main job" (here at
    # tp=2); checkpoints "per (tp, pp): model shard ..."; "HF export: the training layout is resharded into
    # rank 0 alone, which writes `save_pretrained` files".
    assert code == 0
    _one(out, r"\[rlframe\] starting worker groups \(colocated, 2 processes\): actor megatron dp=1 tp=2, "
              r"critic megatron dp=1 tp=2,")
    row = _run_files(out_dir, "ppo_tiny")[0]  # trainer.experiment: ppo_tiny (the default config)
    assert "actor/pg_loss" in row and "critic/vf_loss" in row
    step = out_dir / "ppo_tiny" / "checkpoints" / "step_000001"
    for role in ("actor", "critic"):
        assert sorted(p.name for p in (step / role).glob("mp_*")) == ["mp_00_000", "mp_01_000"], role  # tp 0, 1; pp 0


PROMISES = {
    "python -m rlframe.main --config-name ppo_llama70b trainer.dry_run=true": _check_llama70b_dry_run,
    "rlframe preflight --config-name grpo_tiny rollout.temperature=0.7 actor.ppo_epochs=2": _check_preflight_grpo,
    "rlframe preflight --steps 3 --config-name ppo_tiny actor.lora_rank=8 actor.lora_dropout=0.1": _check_preflight_lora,
    "python -m rlframe.main --config-path examples/custom_algorithm --config-name rft_tiny": _check_rft,
    "python -m rlframe.main --config-path examples/own_data --config-name own_data": _check_own_data,
    "python -m rlframe.main --config-name grpo_series resources.placement=split +resources.split_procs={actor: 1, "
    "rollout: 1} actor.dp=1 trainer.max_staleness=2 trainer.async_mode=stream rollout.partial_budget=128 "
    "algorithm.off_policy_correction=tis": _check_stream,
    "python -m rlframe.main actor.strategy=megatron actor.dp=1 actor.tp=2 critic.strategy=megatron critic.dp=1 "
    "critic.tp=2": _check_megatron,
    "rlframe plan --top 5": _check_plan_top5,
    "rlframe plan -cn grpo_qwen7b --top 3 --constants h100-assumed": _check_plan_qwen7b_top3,
    "python -m rlframe.main trainer.auto_plan=true resources.procs_per_node=4 trainer.dry_run=true":
        _check_auto_plan_dry_run,
    "python -m rlframe.main resources.placement=split +resources.split_procs={actor: 1, rollout: 1} actor.dp=1 "
    "critic.dp=1 trainer.dry_run=true": _check_split_dry_run,
}


def test_every_runnable_command_has_a_promise():
    """A runnable block says what it promises: its commands have a check in PROMISES (and no check is
    left for a command the docs no longer show)."""
    commands = {" ".join(argv) for _, argv in RUNS}
    assert not commands - PROMISES.keys(), f"add a check to PROMISES for: {sorted(commands - PROMISES.keys())}"
    assert not PROMISES.keys() - commands, f"no runnable block runs: {sorted(PROMISES.keys() - commands)}"


def check_outcome(argv, code: int, capfd, out_dir: Path) -> None:
    out, err = capfd.readouterr()
    PROMISES[" ".join(argv)](code, out + err, out_dir)


@pytest.mark.parametrize("argv,where", [u for u in UNIQUE if is_dry(u[0])], ids=lambda v: v if isinstance(v, str) else None)
def test_dry_run_command(argv, where, monkeypatch, tmp_path, tmp_path_factory, capfd):
    from tests.demo_leftovers import clone_after_demo

    monkeypatch.chdir(clone_after_demo(tmp_path_factory.mktemp("clone")))  # the repository root after `make demo`
    # rlframe.main: a dry run prints "without starting anything" (placement.md: "without starting any"):
    # it runs with Ray not importable
    monkeypatch.setitem(sys.modules, "ray", None)
    check_outcome(argv, run_command(argv, tmp_path), capfd, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("argv,where", [u for u in UNIQUE if not is_dry(u[0])], ids=lambda v: v if isinstance(v, str) else None)
def test_run_command(argv, where, monkeypatch, tmp_path, ray_cluster, capfd):
    monkeypatch.chdir(ROOT)
    check_outcome(argv, run_command(argv, tmp_path), capfd, tmp_path)
