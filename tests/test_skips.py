"""Every skip written in the suite is listed in tests/skips.py (the runtime check in conftest.py sees
only the skips that happen on this machine; this one reads them all from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.skips import SKIPS, entry_for, refusal

TESTS = Path(__file__).resolve().parent


def _parts(node) -> list[str]:
    """The constant text of a reason: a string, or an f-string's constant pieces."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    return []


def written_skips():
    """(file:line, constant parts of its reason) of every pytest.skip / importorskip / skipif in tests/."""
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            where = f"{path.relative_to(TESTS.parent)}:{node.lineno}"
            kw = {k.arg: k.value for k in node.keywords}
            if name == "pytest.skip" and node.args:
                yield where, _parts(node.args[0])
            elif name.endswith("skipif") and "reason" in kw:
                yield where, _parts(kw["reason"])
            elif name == "pytest.importorskip" and node.args:
                yield where, (_parts(kw["reason"]) if "reason" in kw else [f"could not import {node.args[0].value!r}"])


def _matches(parts: list[str], listed: str) -> bool:
    """A reason whose text starts with its first constant piece matches an entry that piece starts with
    (or that starts it); one that starts with a value, an entry holding its first piece."""
    first = parts[0] if parts else ""
    return bool(first) and (first.startswith(listed) or listed.startswith(first) or first in listed)


def test_every_written_skip_is_listed():
    found = list(written_skips())
    assert len(found) >= 20, found  # the scan sees the suite's skips
    unlisted = [(where, parts) for where, parts in found if not any(_matches(parts, s.reason) for s in SKIPS)]
    assert not unlisted, f"skips tests/skips.py does not list: {unlisted}"


def test_ci_refuses_what_it_must_run():
    assert refusal("Skipped: mounting a small tmpfs needs root (CI runs as root)", ci=False) is None
    assert "CI must run this test" in refusal("Skipped: mounting a small tmpfs needs root", ci=True)
    assert refusal("Skipped: needs a CUDA GPU; this machine has none", ci=True) is None
    assert "does not list" in refusal("Skipped: no reason at all", ci=False)
    assert entry_for("could not import 'megatron.core': No module named 'megatron'").ci_may_skip is False
