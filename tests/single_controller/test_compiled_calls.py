"""The compiled call path (rlframe/single_controller/compiled.py): once a group's processes have served a
few blocking calls, calls go through one Ray compiled graph. Same results, same errors, nothing kept
on either side aliases a channel, and plain calls still queued are never overtaken. Groups here are
made with RLFRAME_COMPILED_CALLS=all (every call compiled); the default compiles short calls only."""

import contextlib
import os
import time

import pytest
import ray
import torch

from rlframe.single_controller import (Dispatch, RayWorkerGroup, ResourcePool, WorkerCallError, WorkerDiedError,
                                WorkerTimeoutError, register)
from rlframe.single_controller import compiled
from rlframe.protocol import DataProto
from tests.single_controller.workers_for_tests import EchoWorker, FaultyWorker, KeepingWorker, check_rank_one_raises


@contextlib.contextmanager
def compiled_mode(value="all"):
    """RLFRAME_COMPILED_CALLS while groups are made (read once per set of processes)."""
    old = os.environ.get("RLFRAME_COMPILED_CALLS")
    os.environ["RLFRAME_COMPILED_CALLS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RLFRAME_COMPILED_CALLS")
        else:
            os.environ["RLFRAME_COMPILED_CALLS"] = old


def _warm(group, call):
    """Serve blocking calls until the processes' graph is compiled; the path is then compiled."""
    for _ in range(compiled.COMPILE_AFTER + 1):
        call()
    assert group.hosts._graph is not None and group.hosts._graph.usable


@pytest.fixture(scope="module")
def echo4(ray_cluster):
    pool = ResourcePool(procs_per_node=[4], name="compiled-echo")
    with compiled_mode():
        group = RayWorkerGroup(pool, EchoWorker, name="cecho", kwargs={"mesh": {"dp": 2, "tp": 2}}, timeout=120)
    _warm(group, lambda: group.whoami(0))
    yield group
    group.shutdown()
    pool.release()


def test_every_dispatch_mode_gives_the_plain_result(echo4):
    graph = echo4.hosts._graph
    assert echo4.whoami("hi") == [(r, 4, "echo", "hi") for r in range(4)]
    assert echo4.square([1, 2, 3, 4], offset=[0, 0, 0, 100]) == [1, 4, 9, 116]
    assert echo4.only_rank_zero(7) == ("rank-zero", 0, 7)
    data = DataProto.from_dict(tensors={"x": torch.arange(8)}, non_tensors={"uid": list("abcdefgh")})
    out = echo4.double(data, scale=10)
    assert out.batch["x"].tolist() == [0, 10, 20, 30, 40, 50, 60, 70]
    assert out.batch["rank"].tolist() == [0, 0, 0, 0, 2, 2, 2, 2]
    assert out.non_tensor_batch["uid"].tolist() == list("abcdefgh")
    assert echo4.all_reduce_rank() == [10.0] * 4
    # a batch over the inline limit goes through the object store; tp peers get the same chunk
    big = DataProto.from_dict(tensors={"x": torch.arange(200_000)})
    assert echo4.double(big, scale=1).batch["x"].equal(big.batch["x"])
    assert echo4.seen_chunks()[1][-1][:3] == [0, 1, 2] and echo4.seen_chunks()[2][-1][:3] == [100_000, 100_001, 100_002]
    assert echo4.hosts._graph is graph and graph.usable  # all of it on the compiled path


def test_records_split_the_time(echo4):
    from rlframe.single_controller.worker_group import record_calls

    with record_calls() as calls:
        echo4.double(DataProto.from_dict(tensors={"x": torch.arange(4)}))
    [c] = calls
    assert c.method == "double" and 0 <= c.compute_s <= c.answer_s and c.submit_s >= 0 and c.collect_s >= 0


def test_traced_compiled_calls_report_every_rank(echo4, tmp_path):
    from tests.single_controller.test_worker_group import check_traced_calls, traced_calls

    data = DataProto.from_dict(tensors={"x": torch.arange(8)})
    out, events = traced_calls(echo4, tmp_path, data)
    assert out.batch["x"].tolist() == [2 * x for x in range(8)]
    check_traced_calls(events, compiled=True)
    assert echo4.timed_double(data).batch["x"].tolist() == out.batch["x"].tolist()  # untraced again: as before


def test_plain_call_is_not_overtaken_and_kept_values_stay_intact(ray_cluster):
    """A plain call still running keeps the next calls plain (the graph would run them on another
    thread, beside it); once it is gathered, the graph is compiled and takes every call, blocking or
    not, in the order they were made. Then, on the same processes: outputs the driver keeps (numpy,
    tensors, DataProtos) and inputs a worker keeps survive many later calls, and those calls do not
    wait for them (a kept view of a channel would block it)."""
    from rlframe.single_controller.worker_group import CompiledFuture

    pool = ResourcePool(procs_per_node=[2], name="compiled-keep")
    with compiled_mode():
        group = RayWorkerGroup(pool, KeepingWorker, name="keep", timeout=60)
    try:
        # order: needs processes that have served fewer than COMPILE_AFTER + 1 blocking calls
        for _ in range(compiled.COMPILE_AFTER):
            group.num_threads()
        fut = group.record("slow", 1.0, blocking=False)  # plain: no graph yet
        assert group.record("next") == [["slow", "next"]] * 2
        assert group.hosts._graph is None  # not compiled while the plain call was outstanding
        assert fut.get() == [["slow"]] * 2
        assert group.record("third") == [["slow", "next", "third"]] * 2
        assert group.hosts._graph is not None
        first = group.record("a", 0.5, blocking=False)
        second = group.record("b", blocking=False)
        assert isinstance(first, CompiledFuture) and isinstance(second, CompiledFuture)
        assert second.get() == [["slow", "next", "third", "a", "b"]] * 2  # gathered out of order
        assert first.get() == [["slow", "next", "third", "a"]] * 2

        # kept values (the calls above kept nothing, and their answers were small: none stored)
        _warm(group, lambda: group.num_threads())
        assert group.num_threads() == [1, 1]  # torch's per-thread count, set on the graph's thread too
        answers = [group.keep(DataProto.from_dict(tensors={"x": torch.full((1000,), float(k))}), k)
                   for k in range(8)]
        for k, per_rank in enumerate(answers):
            for arr, t, data in per_rank:
                assert float(arr.sum()) == 50_000 * k and float(t.sum()) == 1000 * k
                assert float(data.batch["x"].sum()) == 1000 * k
        assert group.kept_sums() == [[1000.0 * k for k in range(8)]] * 2
        n = compiled.OUTPUT_INLINE_BYTES // 4 + 10  # an answer over the inline limit: object store
        for _ in range(3):
            assert [float(t.sum()) for t in group.big_answer(n)] == [0.0, float(n)]
        # each rank holds its stored answer until the driver says it has it (the next payload)
        held = lambda: ray.get([a.held_answers.remote() for a in group.hosts.actors])  # noqa: E731
        assert held() == [1, 1]
        assert group.num_threads() == [1, 1]
        assert held() == [0, 0]
    finally:
        group.shutdown()
        pool.release()


class BigOrRaiseWorker(KeepingWorker, FaultyWorker):
    """One rank raises while the others answer through the object store (Ray imports it from here);
    FaultyWorker's failures besides."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def big_unless(self, failing_rank, n):
        if self.rank == failing_rank:
            raise ValueError(f"rank {self.rank} fails on purpose")
        return torch.full((n,), float(self.rank))


def test_raising_ranks_keep_the_path_and_let_stored_answers_go_a_dying_one_leaves_it(ray_cluster):
    """A rank that raises is named and the compiled path stays. Ray drops the other ranks' answers
    of a call that raised on one rank, so the driver never fetches them: every rank must still let
    its stored answers of that call go, call after call. A rank that dies (last: it ends the group)
    leaves the path."""
    pool = ResourcePool(procs_per_node=[3], name="compiled-release")
    with compiled_mode():
        group = RayWorkerGroup(pool, BigOrRaiseWorker, name="cflaky", timeout=60)
    try:
        _warm(group, lambda: group.num_threads())
        check_rank_one_raises(group)
        assert group.fail_on(-1, timeout=60) == [0, 1, 2] and group.hosts._graph.usable

        held = lambda: ray.get([a.held_answers.remote() for a in group.hosts.actors])  # noqa: E731
        n = compiled.OUTPUT_INLINE_BYTES // 4 + 10  # over the inline limit: each answer is stored
        for failing in (1, 0, 2):
            said = f"rank {failing} raised ValueError: rank {failing} fails on purpose"  # the rank found by pid
            with pytest.raises(WorkerCallError, match=said):
                group.big_unless(failing, n)
            assert group.hosts._graph.usable
        assert [float(t[-1]) for t in group.big_unless(-1, n)] == [0.0, 1.0, 2.0]  # the path still works
        assert group.num_threads() == [1, 1, 1]  # this payload names what each rank may let go
        assert held() == [0, 0, 0]

        with pytest.raises(WorkerDiedError, match=r"worker group 'cflaky'.*method 'die_on'"):
            group.die_on(2, timeout=60)  # on the compiled path (still usable above)
        assert not group.hosts._graph.usable
    finally:
        group.shutdown()
        pool.release()


@pytest.fixture()
def faulty(ray_cluster):
    """A warmed FaultyWorker group for a test that leaves it broken."""
    pool = ResourcePool(procs_per_node=[3], name="compiled-faulty")
    with compiled_mode():
        group = RayWorkerGroup(pool, FaultyWorker, name="cflaky")
    _warm(group, lambda: group.fail_on(-1, timeout=60))
    yield group
    group.shutdown()
    pool.release()


def test_dead_rank_and_timeout_leave_the_compiled_path(faulty):
    with pytest.raises(WorkerTimeoutError, match=r"did not all answer within 1"):
        faulty.sleep(5, timeout=1)
    assert not faulty.hosts._graph.usable
    assert faulty.fail_on(-1, timeout=60) == [0, 1, 2]  # plain path from now on
    with pytest.raises(WorkerDiedError, match=r"worker group 'cflaky'.*rank 2 died"):
        faulty.die_on(2, timeout=60)


def test_default_compiles_short_calls_only(ray_cluster):
    """The driver's wait on a compiled call is a busy poll, so by default only methods that last
    took under SHORT_CALL_S go compiled; a call made while compiled ones are outstanding follows
    them (order)."""
    from rlframe.single_controller.worker_group import CompiledFuture

    pool = ResourcePool(procs_per_node=[2], name="compiled-short")
    with compiled_mode("short"):
        group = RayWorkerGroup(pool, KeepingWorker, name="short", timeout=60)
    try:
        _warm(group, lambda: group.num_threads())
        short = group.num_threads(blocking=False)
        assert isinstance(short, CompiledFuture) and short.get() == [1, 1]  # short: compiled
        slow = 2 * compiled.SHORT_CALL_S
        assert not isinstance(group.record("a", slow, blocking=False), CompiledFuture)  # not known yet
        group.record("b", slow)  # waits behind "a" (plain, in order); "record" is now known to be long
        c = group.record("c", slow, blocking=False)
        assert not isinstance(c, CompiledFuture)
        first = group.num_threads(blocking=False)  # plain too: "c" is still running
        assert not isinstance(first, CompiledFuture) and first.get() == [1, 1]
        # "c" ran before "first" on every rank, but Ray may register its replies on the driver in
        # either order: the group looks at "c" (never gathered) through done(), as here
        deadline = time.monotonic() + 30
        while not c.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        quick = group.num_threads(blocking=False)
        assert isinstance(quick, CompiledFuture)
        follows = group.record("d", slow, blocking=False)  # long, but "quick" may still be outstanding
        assert quick.get() == [1, 1] and follows.get() == [["a", "b", "c", "d"]] * 2
    finally:
        group.shutdown()
        pool.release()


def test_switch_off(monkeypatch, ray_cluster):
    monkeypatch.setenv("RLFRAME_COMPILED_CALLS", "0")
    pool = ResourcePool(procs_per_node=[1], name="compiled-off")
    group = RayWorkerGroup(pool, KeepingWorker, name="off", timeout=60)
    try:
        for _ in range(compiled.COMPILE_AFTER + 2):
            group.num_threads()
        assert group.hosts._graph is None
    finally:
        group.shutdown()
        pool.release()
