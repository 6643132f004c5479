import json

import pyarrow.parquet as pq
import pytest

from rlframe.data.synthetic import ArithmeticSpec, SeriesSpec, arithmetic_rows, countdown_rows, main, series_rows
from rlframe.rewards.registry import default_compute_score


def test_arithmetic_is_deterministic_disjoint_and_verifies():
    spec = ArithmeticSpec(digits=2, ops="+-*")
    a = arithmetic_rows(num_train=300, num_test=50, spec=spec, seed=3)
    b = arithmetic_rows(num_train=300, num_test=50, spec=spec, seed=3)
    c = arithmetic_rows(num_train=300, num_test=50, spec=spec, seed=4)
    assert a == b and a != c
    train = {r["prompt"][0]["content"] for r in a["train"]}
    test = {r["prompt"][0]["content"] for r in a["test"]}
    assert len(train) == 300 and len(test) == 50 and not train & test
    for row in a["train"] + a["test"]:
        prompt, gt = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
        x, op, y = next((prompt[:i], prompt[i], prompt[i + 1 : -1]) for i in range(1, len(prompt)) if prompt[i] in "+-*")
        assert int(gt) == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        assert int(gt) >= 0  # no negatives unless asked for
        assert default_compute_score(row["data_source"], gt, gt) == 1.0


def test_arithmetic_rejects_impossible_requests():
    with pytest.raises(ValueError, match="only 100 exist"):
        arithmetic_rows(num_train=150, num_test=0, spec=ArithmeticSpec(digits=1), seed=0)
    with pytest.raises(ValueError, match="subset"):
        arithmetic_rows(num_train=1, num_test=1, spec=ArithmeticSpec(ops="/"), seed=0)


def test_countdown_every_stored_solution_verifies():
    rows = countdown_rows(num_train=200, num_test=40, seed=1, count=3, max_number=9)
    assert rows == countdown_rows(num_train=200, num_test=40, seed=1, count=3, max_number=9)
    for row in rows["train"] + rows["test"]:
        gt = row["reward_model"]["ground_truth"]
        assert default_compute_score("countdown", row["extra_info"]["solution"], gt) == 1.0
        assert row["prompt"][0]["content"].endswith(f"->{json.loads(gt)['target']}:")


def test_series_counts_down_its_terms_and_lengths_have_a_long_tail():
    spec = SeriesSpec()
    rows = series_rows(num_train=2000, num_test=200, spec=spec, seed=1)
    assert rows == series_rows(num_train=2000, num_test=200, spec=spec, seed=1)
    train = {r["prompt"][0]["content"] for r in rows["train"]}
    test = {r["prompt"][0]["content"] for r in rows["test"]}
    assert len(train) == 2000 and len(test) == 200 and not train & test
    lengths = {"train": [], "test": []}
    for split, items in rows.items():
        for row in items:
            start, rest = row["prompt"][0]["content"].rstrip("=").split("+")
            step, terms = map(int, rest.split("x"))
            assert 0 <= int(start) <= spec.max_start and 1 <= step <= spec.max_step
            assert 1 <= terms == row["extra_info"]["terms"] <= spec.max_terms
            gt = row["reward_model"]["ground_truth"]
            # "94+9x3=" -> "2:103,1:112,0:121": each term is the count still to come and the value
            assert gt.split(",") == [f"{terms - i}:{int(start) + step * i}" for i in range(1, terms + 1)]
            assert default_compute_score("series", gt, gt) == 1.0
            lengths[split].append(len(gt))
    for split in lengths:  # tens of characters typically, hundreds in the tail; both splits alike
        ls = sorted(lengths[split])
        assert 25 <= ls[len(ls) // 2] <= 55 and ls[int(0.9 * len(ls))] >= 110 and 200 <= ls[-1] <= 280
    with pytest.raises(ValueError, match="0 <= tail < 1"):
        series_rows(num_train=1, num_test=1, spec=SeriesSpec(tail=1.0), seed=0)
    with pytest.raises(ValueError, match="distinct series"):
        series_rows(num_train=100, num_test=0, spec=SeriesSpec(max_start=2, max_step=2, max_terms=3), seed=0)


def test_command_writes_parquet_splits(tmp_path, capsys):
    paths = main(["--task", "countdown", "--out", str(tmp_path), "--num-train", "30", "--num-test", "10", "--seed", "2"])
    assert "wrote 30 train rows" in capsys.readouterr().out
    train = pq.read_table(paths["train"]).to_pylist()
    assert len(train) == 30 and len(pq.read_table(paths["test"]).to_pylist()) == 10
    assert train[0]["reward_model"]["style"] == "rule"
    assert train[0]["prompt"][0]["role"] == "user"
