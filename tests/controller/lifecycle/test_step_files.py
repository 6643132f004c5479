"""The run's step-keyed jsonl files: rotation by size (the oldest deleted), and trimming to a step
that drops a line a kill cut off and leaves an untouched file as it was."""

from rlframe.controller.lifecycle.step_files import RotatingJsonl, read_jsonl, trim_jsonl


def test_files_rotate_at_their_size_bound(tmp_path):
    files = RotatingJsonl(tmp_path, "train", max_bytes=1000, keep=2)
    for step in range(1, 21):
        files.append([{"step": step, "index": i, "response": "x" * 100} for i in range(4)])
    parts = files.parts()
    assert [p.name for p in parts] == ["train.jsonl", "train.jsonl.1", "train.jsonl.2"]
    assert all(p.stat().st_size < 1000 + 4 * 140 for p in parts)  # a file grows past the bound by one append at most
    steps = [[r["step"] for r in read_jsonl(p)] for p in reversed(parts)]
    flat = [s for part in steps for s in part]
    assert flat == sorted(flat) and flat[-1] == 20 and flat[0] > 1  # the oldest rows were deleted


def test_trim_keeps_earlier_steps_drops_a_cut_line_and_rewrites_only_when_needed(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "x": 1}}\n' for s in range(1, 5)) + '{"step": 5, "x"')
    assert trim_jsonl(path, 3) == 2
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3] and path.read_text().endswith("\n")
    mtime = path.stat().st_mtime_ns
    assert trim_jsonl(path, 3) == 0 and path.stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob(".*"))  # no temporary file left
    assert trim_jsonl(tmp_path / "absent.jsonl", 3) == 0
