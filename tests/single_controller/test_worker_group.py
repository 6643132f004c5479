"""Worker groups on a real local Ray: dispatch per rank, colocation, failures, concurrency."""

import pytest
import torch

from rlframe.single_controller import (
    GroupFuture, RayWorkerGroup, ResourcePool, RoleSpec, WorkerCallError, WorkerDiedError,
    WorkerTimeoutError,
)
from rlframe.protocol import DataProto
from tests.single_controller.workers_for_tests import EchoWorker, FaultyWorker, check_rank_one_raises


@pytest.fixture(scope="module")
def echo4(ray_cluster):
    pool = ResourcePool(procs_per_node=[4], name="echo-pool")
    group = RayWorkerGroup(pool, EchoWorker, name="echo", kwargs={"mesh": {"dp": 2, "tp": 2}}, timeout=120)
    yield group
    group.shutdown()
    pool.release()


def test_one_to_all_all_to_all_rank_zero(echo4):
    assert echo4.whoami("hi") == [(r, 4, "echo", "hi") for r in range(4)]
    assert echo4.square([1, 2, 3, 4], offset=[0, 0, 0, 100]) == [1, 4, 9, 116]
    before = echo4.call_count()
    assert echo4.only_rank_zero(7) == ("rank-zero", 0, 7)
    after = echo4.call_count()
    assert [a - b for a, b in zip(after, before)] == [1, 0, 0, 0]


def test_dp_compute_splits_over_dp_and_gathers_in_order(echo4):
    data = DataProto.from_dict(tensors={"x": torch.arange(8)}, non_tensors={"uid": list("abcdefgh")})
    out = echo4.double(data, scale=10)
    assert out.batch["x"].tolist() == [0, 10, 20, 30, 40, 50, 60, 70]
    # chunks from dp rank 0 are collected from rank 0 (tp=0), dp rank 1 from rank 2
    assert out.batch["rank"].tolist() == [0, 0, 0, 0, 2, 2, 2, 2]
    seen = [chunks[-1] for chunks in echo4.seen_chunks()]
    assert seen == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]


def test_dp_compute_on_a_second_mesh(echo4):
    data = DataProto.from_dict(tensors={"x": torch.arange(8)})
    out = echo4.tag_rank(data)  # mesh "flat" is dp=4: every rank gets 2 rows and is collected
    assert out.batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert out.batch["x"].tolist() == list(range(8))


def test_one_batch_for_all_ranks_and_call_records(echo4):
    """A DataProto sent to every rank (put in the object store once) arrives whole on each; the
    call's record splits its time into driver work, answer wait and the workers' compute."""
    from rlframe.single_controller.worker_group import record_calls

    data = DataProto.from_dict(tensors={"x": torch.arange(6)})
    with record_calls() as calls:
        out = echo4.whoami(data)
        echo4.double(DataProto.from_dict(tensors={"x": torch.arange(4)}))
    assert [o[0] for o in out] == [0, 1, 2, 3] and all(o[3].batch["x"].tolist() == list(range(6)) for o in out)
    assert [c.method for c in calls] == ["whoami", "double"]
    for c in calls:
        assert 0 <= c.compute_s <= c.answer_s and c.submit_s >= 0 and c.collect_s >= 0


def traced_calls(group, tmp_path, data):
    """`group.timed_double(data)` and `group.only_rank_zero(5)` in a traced step: (output, events)."""
    import json

    from rlframe.utils import trace

    trace.open_trace(tmp_path)
    try:
        trace.at_step(1)
        with trace.span("step"):
            out = group.timed_double(data)
            group.only_rank_zero(5, blocking=False).get()
    finally:
        trace.close_trace()
    return out, json.load(open(tmp_path / "trace.json"))


def check_traced_calls(events, *, compiled: bool) -> None:
    """Each call once per called rank (dp=2 x tp=2: every rank gets its dp chunk of 4 rows, the tp=0
    ranks' outputs are gathered), with the phase timed inside it nested under it, all in the step."""
    xs = [e for e in events if e["ph"] == "X"]
    [step] = [e for e in xs if e["name"] == "step"]

    def inside(a, b):
        return b["ts"] <= a["ts"] and a["ts"] + a["dur"] <= b["ts"] + b["dur"]

    doubles = {e["tid"]: e for e in xs if e["name"] == "timed_double"}
    assert sorted(doubles) == [0, 1, 2, 3] and len({e["args"]["call"] for e in doubles.values()}) == 1
    assert {r: e["args"]["bytes_in"] for r, e in doubles.items()} == {r: 4 * 8 for r in range(4)}
    assert {r: e["args"]["bytes_out"] for r, e in doubles.items()} == {0: 4 * 8, 1: 0, 2: 4 * 8, 3: 0}
    for e in doubles.values():
        assert e["args"]["compiled"] is compiled and e["args"]["step"] == 1 and inside(e, step)
    work = [e for e in xs if e["name"] == "work"]
    assert sorted(e["tid"] for e in work) == [0, 1, 2, 3]
    assert all(inside(w, doubles[w["tid"]]) and w["dur"] >= 0.05e6 for w in work)
    [zero] = [e for e in xs if e["name"] == "only_rank_zero"]
    assert zero["tid"] == 0 and inside(zero, step)
    groups = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert groups[zero["pid"]] == groups[doubles[0]["pid"]] != "driver"


def test_traced_calls_report_every_rank(echo4, tmp_path):
    data = DataProto.from_dict(tensors={"x": torch.arange(8)})
    out, events = traced_calls(echo4, tmp_path, data)
    assert out.batch["x"].tolist() == [2 * x for x in range(8)] == echo4.timed_double(data).batch["x"].tolist()
    check_traced_calls(events, compiled=False)
    # a tp peer's chunk is the same object: put once, fetched by the rank inside its call
    fetches = [e for e in events if e["ph"] == "X" and e["name"] == "fetch_args"]
    assert sorted(e["tid"] for e in fetches) == [0, 1, 2, 3]


def test_all_reduce_across_four_processes(echo4):
    assert echo4.all_reduce_rank() == [10.0] * 4
    assert len(set(echo4.pid())) == 4


@pytest.fixture(scope="module")
def hybrid(ray_cluster):
    """Two EchoWorker roles, "actor" and "ref", colocated in one process per rank on 2 ranks. Only
    test_colocated_roles_share_processes calls their counted methods (whoami and the like)."""
    pool = ResourcePool(procs_per_node=[2], name="colo-pool")
    groups = RayWorkerGroup.colocated(
        pool, {"actor": RoleSpec(EchoWorker, kwargs={"tag": "actor"}),
               "ref": RoleSpec(EchoWorker, kwargs={"tag": "ref"})}, name="hybrid")
    yield groups
    groups["actor"].shutdown()
    pool.release()


def test_non_blocking_calls_run_two_groups_at_once(echo4, hybrid, tmp_path):
    """Group A waits for a file that group B writes: only possible if A's call does not block."""
    flag = tmp_path / "flag"
    fut = echo4.wait_for_file(str(flag), 60.0, blocking=False)
    assert isinstance(fut, GroupFuture)
    assert hybrid["ref"].touch(str(flag)) is True
    assert fut.get(timeout=60) == [True] * 4


def test_colocated_roles_share_processes(hybrid):
    actor, ref = hybrid["actor"], hybrid["ref"]
    assert actor.pid() == ref.pid()
    assert [t for _, _, t, _ in actor.whoami(0)] == ["actor", "actor"]
    assert [t for _, _, t, _ in ref.whoami(0)] == ["ref", "ref"]
    assert actor.call_count() == [1, 1] and ref.call_count() == [1, 1]


def faulty_group(pool_name: str) -> RayWorkerGroup:
    """A FaultyWorker group "flaky" on 3 ranks, on a pool of its own (`close` releases it)."""
    return RayWorkerGroup(ResourcePool(procs_per_node=[3], name=pool_name), FaultyWorker, name="flaky")


def close(group: RayWorkerGroup) -> None:
    group.shutdown()
    group.hosts.pool.release()


@pytest.fixture(scope="module")
def faulty(ray_cluster):
    """A FaultyWorker group shared by the tests that leave it usable (a rank raising, a call timing out,
    a late barrier); a test that kills a rank makes its own. Its calls all take the plain Ray path
    (RLFRAME_COMPILED_CALLS=0), as each call of a fresh group does: the compiled path's failures are
    tests/single_controller/test_compiled_calls.py's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLFRAME_COMPILED_CALLS", "0")
        group = faulty_group("faulty-pool")
    yield group
    close(group)


def test_raising_worker_names_group_role_rank(faulty):
    check_rank_one_raises(faulty)
    assert faulty.later(10).get(timeout=60) == [10, 11, 12]  # the group is still usable


def test_killed_worker_surfaces_without_hang(ray_cluster):
    group = faulty_group("killed-pool")  # a rank dies: a group of its own
    try:
        with pytest.raises(WorkerDiedError, match=r"worker group 'flaky'.*rank 2 died"):
            group.die_on(2, timeout=60)
    finally:
        close(group)


def test_call_timeout(faulty):
    with pytest.raises(WorkerTimeoutError, match=r"ranks \[0, 1, 2\] did not answer within 1"):
        faulty.sleep(3, timeout=1)
    assert faulty.sleep(0, timeout=60) == [0, 1, 2]  # queued behind the late answers: usable again


def test_collectives_wait_for_the_configured_timeout(faulty):
    from rlframe.single_controller.worker_group import HostSet

    # the short group's processes start (join=False) while the barrier below waits for its late rank
    pool = ResourcePool(procs_per_node=[2], name="short-pool")
    hosts = HostSet(pool, name="short", collective_timeout_s=1.0, join=False)
    try:
        # the default (30 min) outlasts one rank arriving late at a barrier
        assert faulty.late_barrier(1, 3.0, timeout=60) == [0, 1, 2]
        short = RayWorkerGroup.colocated(pool, {"short": RoleSpec(FaultyWorker)}, name="short", hosts=hosts)["short"]
        with pytest.raises(WorkerCallError, match=r"method 'late_barrier'"):
            short.late_barrier(1, 4.0, timeout=60)
    finally:
        hosts.shutdown()
        pool.release()
