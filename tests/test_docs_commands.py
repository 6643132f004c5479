"""The commands the README and docs tell a user to type still run.

Every ```bash block in README.md, docs/*.md and examples/*/README.md is preceded (on the line before
it, blank lines allowed) by one of

    <!-- runnable -->                 the test runs every command of the block
    <!-- not runnable: WHY -->        it does not (needs a cluster, a GPU, a previous run, ...)

A block without either fails `test_every_bash_block_is_marked`. Runnable commands run in this
process, in the repository root: `python -m rlframe.main ARGS` as rlframe.main.main(ARGS), `rlframe
CMD ARGS` as rlframe.cli.main([CMD, *ARGS]), sharing the session's Ray (the `ray_cluster` fixture).
A dry run (`trainer.dry_run=true`) runs as written; any other run gets SHORT appended (one step, no
validation, a temporary output directory), and `rlframe preflight` keeps its own step count. Each
must exit 0.
"""

from __future__ import annotations

import re
import shlex
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
    if not is_dry(argv):
        args += [f"trainer.output_dir={out_dir}"] + ([] if args[:1] == ["preflight"] else SHORT)
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


@pytest.mark.parametrize("argv,where", [u for u in UNIQUE if is_dry(u[0])], ids=lambda v: v if isinstance(v, str) else None)
def test_dry_run_command(argv, where, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert run_command(argv, tmp_path) == 0, f"{where}: {' '.join(argv)}"


@pytest.mark.slow
@pytest.mark.parametrize("argv,where", [u for u in UNIQUE if not is_dry(u[0])], ids=lambda v: v if isinstance(v, str) else None)
def test_run_command(argv, where, monkeypatch, tmp_path, ray_cluster):
    monkeypatch.chdir(ROOT)
    assert run_command(argv, tmp_path) == 0, f"{where}: {' '.join(argv)} (with the short-run overrides appended)"
