"""Dispatch modes as pure functions: exact per-rank inputs and gathered outputs."""

import pytest
import torch

from rlframe.single_controller.decorator import register, registered_methods
from rlframe.single_controller.dispatch import RankInfo, get_dispatch_mode, register_dispatch_mode
from rlframe.single_controller.mesh import Mesh
from rlframe.single_controller.worker import Worker, WorkerContext, build_role
from rlframe.protocol import DataProto


def infos(n):
    return [RankInfo(rank=r, dp_rank=r, dp_size=n, collect=True) for r in range(n)]


def mesh_infos(mesh: Mesh):
    out = []
    for r in range(mesh.world_size):
        w = build_role(Worker, WorkerContext("g", "role", r, mesh.world_size, 0, "gloo"), (), {})
        w.set_mesh(mesh)
        out.append(w.rank_info())
    return out


def test_one_to_all_and_rank_zero():
    mode = get_dispatch_mode("one_to_all")
    assert mode.split((1,), {"k": 2}, infos(3)) == [((1,), {"k": 2})] * 3
    assert mode.collect(list(zip(infos(3), "abc"))) == ["a", "b", "c"]
    rz = get_dispatch_mode("rank_zero")
    assert rz.split((1,), {}, infos(3)) == [((1,), {}), None, None]
    assert rz.collect([(infos(3)[0], "zero")]) == "zero"


def test_all_to_all_per_rank_items_and_error():
    mode = get_dispatch_mode("all_to_all")
    assert mode.split(([1, 2],), {"o": [10, 20]}, infos(2)) == [((1,), {"o": 10}), ((2,), {"o": 20})]
    with pytest.raises(ValueError, match=r"one item per rank \(2\); argument 0 is a list of length 3"):
        mode.split(([1, 2, 3],), {}, infos(2))


def test_dp_compute_follows_mesh():
    mesh = Mesh.of(dp=2, tp=2)
    ranks = mesh_infos(mesh)
    assert [(r.dp_rank, r.collect) for r in ranks] == [(0, True), (0, False), (1, True), (1, False)]
    data = DataProto.from_dict(tensors={"x": torch.arange(4)})
    mode = get_dispatch_mode("dp_compute")
    calls = mode.split((data,), {"scale": 3}, ranks)
    got = [c[0][0].batch["x"].tolist() for c in calls]
    assert got == [[0, 1], [0, 1], [2, 3], [2, 3]]  # tp peers get the same chunk
    assert all(c[1] == {"scale": 3} for c in calls)
    outs = [(r, DataProto.from_dict(tensors={"x": torch.tensor([r.rank, r.rank])})) for r in ranks]
    assert mode.collect(outs).batch["x"].tolist() == [0, 0, 2, 2]  # one rank per dp group, dp order


def test_dp_compute_pipeline_collects_last_stage():
    ranks = mesh_infos(Mesh.of(pp=2, dp=1, tp=2))
    assert [r.collect for r in ranks] == [False, False, True, False]


def test_dp_compute_indivisible_batch_error():
    data = DataProto.from_dict(tensors={"x": torch.arange(5)})
    with pytest.raises(ValueError, match=r"batch size 5 over dp=2: 5 % 2 = 1"):
        get_dispatch_mode("dp_compute").split((data,), {}, infos(2))


def test_unknown_and_duplicate_modes():
    with pytest.raises(ValueError, match="unknown dispatch mode 'scatter_gather'"):
        register(dispatch="scatter_gather")
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("one_to_all", split=lambda *a: [], collect=lambda o: o)


def test_new_mode_is_a_table_entry():
    register_dispatch_mode(
        "last_rank_only",
        split=lambda a, k, ranks: [(a, k) if r.rank == len(ranks) - 1 else None for r in ranks],
        collect=lambda outs: outs[-1][1],
    )

    class W(Worker):
        @register(dispatch="last_rank_only")
        def f(self):
            return self.rank

    assert registered_methods(W)["f"].dispatch == "last_rank_only"


def test_reserved_kwargs_rejected():
    with pytest.raises(ValueError, match="reserves"):
        class W(Worker):
            @register()
            def f(self, timeout):
                return timeout
