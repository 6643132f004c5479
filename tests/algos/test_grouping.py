import numpy as np
import pytest
import torch

from rlframe.algos.grouping import group_mean, group_rows, group_std


@pytest.mark.parametrize(
    "index",
    [
        np.array(["b", "a", "b", "c", "a"], dtype=object),
        np.array([7, 3, 7, 1, 3]),
        torch.tensor([7, 3, 7, 1, 3]),
        ["b", "a", "b", "c", "a"],
    ],
    ids=["object-array", "int-array", "int-tensor", "list"],
)
def test_groups_numbered_in_order_of_first_appearance(index):
    groups = group_rows(index, batch_size=5)
    assert groups.inverse.tolist() == [0, 1, 0, 2, 1]
    assert groups.counts.tolist() == [2, 2, 1]
    assert len(groups.ids) == 3 and groups.ids[0] == list(index)[0]


def test_group_statistics_match_torch_per_group():
    torch.manual_seed(0)
    x = torch.randn(10, dtype=torch.float64)
    index = np.array([i % 3 for i in range(10)])
    groups = group_rows(index, batch_size=10)
    for g in range(3):
        members = x[torch.as_tensor(index == g)]
        assert torch.isclose(group_mean(x, groups)[g], members.mean())
        assert torch.isclose(group_std(x, groups)[g], members.std())


def test_bad_index_errors():
    with pytest.raises(ValueError, match="index has 3 group ids but the batch has 4 rows"):
        group_rows(["a", "a", "b"], batch_size=4)
    with pytest.raises(ValueError, match="index must be 1-D"):
        group_rows(np.zeros((2, 2)), batch_size=2)
    with pytest.raises(ValueError, match="is required"):
        group_rows(None, batch_size=2)
    groups = group_rows(["a", "b", "b"], batch_size=3)
    with pytest.raises(ValueError, match=r"group 'a' has 1 sample\(s\) but needs at least 2"):
        groups.require_min_size(2, algorithm="x", why="y")
