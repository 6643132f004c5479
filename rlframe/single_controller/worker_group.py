"""RayWorkerGroup: the driver-side handle of one role running on N ranks.

    pool = ResourcePool(procs_per_node=[4])
    actor = RayWorkerGroup(pool, ActorWorker, name="actor", kwargs={"config": cfg})
    out = actor.compute_log_prob(batch)                    # split -> call all ranks -> gather
    fut = actor.compute_log_prob(batch, blocking=False)     # runs while the driver goes on
    out = fut.get(timeout=60)

Every method of the worker class marked `@register(dispatch=...)` becomes a method of the group
with the same name. Colocated roles (`RayWorkerGroup.colocated`) share one process per rank.
A rank that raises or dies surfaces here as an exception naming the group, role, rank and method;
a call that outlives its timeout raises instead of hanging.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from rlframe.single_controller import compiled, transport
from rlframe.utils import startup
from rlframe.single_controller.decorator import registered_methods
from rlframe.single_controller.dispatch import RankInfo, get_dispatch_mode
from rlframe.single_controller.host import COMM_ENV_PREFIXES, MULTI_HOST_ENV, WorkerHost
from rlframe.single_controller.resource_pool import ResourcePool
from rlframe.utils import trace


class WorkerGroupError(RuntimeError):
    """A call on a worker group failed: a rank raised, died, or did not answer in time."""


class WorkerDiedError(WorkerGroupError):
    pass


class WorkerCallError(WorkerGroupError):
    pass


class WorkerTimeoutError(WorkerGroupError):
    pass


@dataclass
class CallRecord:
    """Where the time of one group call went (seconds), for the trainer's overhead breakdown."""

    group: str
    method: str
    submit_s: float  # driver: split the arguments, serialize them, submit one Ray call per rank
    answer_s: float  # from the last submit until every rank answered
    collect_s: float  # driver: deserialize and gather the outputs
    compute_s: float  # the slowest rank's time inside the method
    key: tuple[str, str] | None = None  # (role, method)
    durations: dict | None = field(default=None, repr=False)  # where the group keeps key -> compute_s
    trace: "trace.PendingCall | None" = field(default=None, repr=False)  # trainer.trace: the ranks' timeline

    @property
    def wall_s(self) -> float:
        return self.submit_s + self.answer_s + self.collect_s


_recorders: list[tuple[int, list[CallRecord]]] = []


@contextlib.contextmanager
def record_calls() -> Iterator[list[CallRecord]]:
    """Collect a CallRecord for every group call gathered inside the block by this thread (streaming
    rollouts gather their generation calls in a thread of their own)."""
    calls: list[CallRecord] = []
    entry = (threading.get_ident(), calls)
    _recorders.append(entry)
    try:
        yield calls
    finally:
        _recorders.remove(entry)


@dataclass
class RoleSpec:
    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def _wait_all(calls: list[tuple[RankInfo, Any]], *, timeout: float | None, what: str) -> list[tuple[RankInfo, Any]]:
    """ray.get every (rank, ref), failing fast on the first rank that raises or dies.

    One `ray.wait` for all ranks at a time (not one per rank): it returns at once when all have
    answered, and otherwise wakes up at growing intervals (10 ms to 1 s) to fetch what has
    answered, so a rank that fails is reported while the others may still be stuck waiting for it.
    """
    import ray

    pending = {ref: info for info, ref in calls}
    results: dict[int, tuple[RankInfo, Any]] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    interval = 0.01
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = interval if remaining is None else min(interval, remaining)
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=step)
        if ready:
            _fetch(ready, pending, results, what=what)
        elif remaining is not None and remaining <= step:
            ranks = sorted(info.rank for info in pending.values())
            raise _timeout_error(what, f"ranks {ranks} did not answer", timeout)
        interval = min(1.0, interval * 2)
    return [results[r] for r in sorted(results)]


def _timeout_error(what: str, who: str, timeout: float | None) -> WorkerTimeoutError:
    return WorkerTimeoutError(
        f"{what}: {who} within {timeout}s (a rank may be stuck in a collective because another rank "
        "failed or took a different path); pass a larger timeout= or check the workers' logs")


def _fetch(ready: list, pending: dict, results: dict, *, what: str) -> None:
    """Move the answered refs from `pending` into `results`; raise naming the rank that failed."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        values = ray.get(ready)
    except (RayActorError, RayTaskError):
        values = None  # find the failing rank below, one ref at a time
    for i, ref in enumerate(ready):
        info = pending.pop(ref)
        try:
            results[info.rank] = (info, values[i] if values is not None else ray.get(ref))
        except RayActorError as err:
            raise WorkerDiedError(f"{what}: rank {info.rank} died: {err}") from err
        except RayTaskError as err:
            raise WorkerCallError(
                f"{what}: rank {info.rank} raised {type(err.cause).__name__}: {err.cause}\n{err}"
            ) from err


class GroupFuture:
    """The pending result of a non-blocking group call; `get()` gathers it."""

    def __init__(self, *, calls, collect, what: str, timeout: float | None, record: CallRecord | None = None,
                 zero_copy: bool = False, hosts: "HostSet | None" = None):
        self._calls, self._collect, self._what, self._timeout = calls, collect, what, timeout
        self._zero_copy, self._hosts = zero_copy, hosts
        if hosts is not None:
            hosts.outstanding.append(self)
        self._record, self._submitted_at = record, time.perf_counter()

    @property
    def refs(self) -> list:
        return [ref for _, ref in self._calls]

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def get(self, timeout: float | None = None):
        from rlframe.protocol import receive_zero_copy

        # Where the gather copies anyway (concat), outputs skip their private copy on arrival.
        try:
            with receive_zero_copy() if self._zero_copy else contextlib.nullcontext():
                outs = _wait_all(self._calls, timeout=self._timeout if timeout is None else timeout, what=self._what)
        finally:
            if self._hosts is not None and self in self._hosts.outstanding:
                self._hosts.outstanding.remove(self)
        return _gathered(outs, self._collect, self._record, submitted_at=self._submitted_at)


def _gathered(outs: list[tuple[RankInfo, tuple]], collect, record: CallRecord | None, *, submitted_at: float):
    """The collected result of every rank's (output, seconds) (traced calls: (output, seconds, start,
    end, spans), WorkerHost.call); completes and files `record`."""
    answered = time.perf_counter()
    result = collect([(info, answer[0]) for info, answer in outs])
    if record is not None:
        record.answer_s = answered - submitted_at
        record.collect_s = time.perf_counter() - answered
        record.compute_s = max((answer[1] for _, answer in outs), default=0.0)
        if record.durations is not None:
            record.durations[record.key] = record.compute_s
        for thread, calls in _recorders:
            if thread == threading.get_ident():
                calls.append(record)
        if record.trace is not None:
            record.trace.finish([(info.rank, answer) for info, answer in outs], transport.payload_bytes)
    return result


class CompiledFuture(GroupFuture):
    """A call submitted through the compiled graph (compiled.py); `get()` gathers it like GroupFuture.
    The payloads (and the object-store references in them) are held until then."""

    def __init__(self, *, graph, refs, payloads, infos, collect, what: str, timeout: float | None,
                 record: CallRecord, zero_copy: bool):
        super().__init__(calls=[], collect=collect, what=what, timeout=timeout, record=record, zero_copy=zero_copy)
        self._graph, self._refs, self._payloads, self._infos = graph, refs, payloads, infos
        self._got = False

    @property
    def refs(self) -> list:
        return list(self._refs)

    def done(self) -> bool:
        """True once gathered (a compiled call's answers cannot be polled without reading them)."""
        return self._got

    def get(self, timeout: float | None = None):
        from ray.exceptions import RayTaskError

        from rlframe.protocol import receive_zero_copy

        limit = self._timeout if timeout is None else timeout
        try:
            with receive_zero_copy() if self._zero_copy else contextlib.nullcontext():
                answers = self._graph.collect(self._refs, timeout=limit)
        except RayTaskError as err:
            raise WorkerCallError(f"{self._what}: rank {self._graph.failed_rank(err)} raised "
                                  f"{type(err.cause).__name__}: {err.cause}\n{err}") from err
        except compiled.CompiledCallError as err:
            if "Timeout" in str(err):
                raise _timeout_error(self._what, "the ranks did not all answer", limit) from err
            raise WorkerDiedError(f"{self._what}: a rank's process died or its channel closed ({err})") from err
        finally:
            self._payloads, self._got = None, True  # answered or failed, the call is no longer outstanding
        outs = [(info, a) for info, a in zip(self._infos, answers) if a is not None]
        return _gathered(outs, self._collect, self._record, submitted_at=self._submitted_at)


def communication_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k.startswith(COMM_ENV_PREFIXES)}


def multi_host_env() -> dict[str, str]:
    """{MULTI_HOST_ENV: "1"} when the cluster's nodes, alive or dead, have more than one address (the
    workers then bind gloo to their node's interface: host.bind_gloo_to_node_interface). Dead ones
    count: a group started while a lost host is still on its way back will span it."""
    import ray

    addresses = {n["NodeManagerAddress"] for n in ray.nodes()}
    return {MULTI_HOST_ENV: "1"} if len(addresses) > 1 else {}


# How long a collective (a barrier, an all-reduce) waits for the slowest rank before failing: long
# enough for multi-GB checkpoint writes and model loads on one rank while the others wait.
COLLECTIVE_TIMEOUT_S = 1800.0


class HostSet:
    """The Ray actors (one per rank) of a pool, joined in one torch.distributed group.

    init_timeout_s bounds the driver's wait for the processes to start and join; collective_timeout_s
    is the process group's timeout, which every collective of the workers runs under."""

    def __init__(self, pool: ResourcePool, *, name: str, env: dict[str, str] | None = None,
                 init_timeout_s: float = 120.0, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 join: bool = True):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.pool = name, pool
        self._init_timeout_s, self._collective_timeout_s = init_timeout_s, collective_timeout_s
        remote = ray.remote(WorkerHost)
        env = {"TOKENIZERS_PARALLELISM": "false", **communication_env(), **multi_host_env(), **(env or {})}
        self.actors = [
            remote.options(
                num_cpus=pool.cpus_per_proc,
                num_gpus=1 if pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=idx
                ),
                runtime_env={"env_vars": env},
            ).remote(group=name, rank=r, world_size=pool.world_size,
                     num_threads=max(1, int(pool.cpus_per_proc)), env=env)
            for r, (pg, idx) in enumerate(pool.slots())
        ]
        self.joined = False
        self.outstanding: list[GroupFuture] = []  # non-blocking calls not gathered yet
        self._graph: compiled.CompiledCalls | None = None
        self._graph_mode = compiled.mode()
        self._graph_allowed = self._graph_mode != "off"
        self.compiled_outstanding: list[CompiledFuture] = []
        self.last_compute_s: dict[tuple[str, str], float] = {}  # (role, method) -> slowest rank's time
        self._blocking_calls = 0
        if join:
            self.join()

    def join(self) -> None:
        """Wait for the processes to start and join them in one torch.distributed group (once).
        With join=False the processes start in the background (importing torch and the worker
        classes) while the driver goes on, e.g. loading the tokenizer and data."""
        if self.joined:
            return
        infos = [RankInfo(rank=r, dp_rank=r, dp_size=len(self.actors), collect=True) for r in range(len(self.actors))]
        what, timeout = f"worker group {self.name!r} start-up", self._init_timeout_s
        [(_, (addr, port))] = _wait_all([(infos[0], self.actors[0].address.remote())], timeout=timeout, what=what)
        _wait_all(
            [(i, a.init_distributed.remote(master_addr=addr, master_port=port, timeout_s=self._collective_timeout_s))
             for i, a in zip(infos, self.actors)],
            timeout=timeout, what=what,
        )
        self.joined = True
        startup.mark("worker processes")

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def rank_nodes(self) -> list[str | None]:
        """The Ray node id each rank was placed on (None where the pool was never placed)."""
        ids = self.pool.node_ids()
        if not ids:
            return [None] * len(self.actors)
        return [node for node, n in zip(ids, self.pool.procs_per_node) for _ in range(n)]

    def compiled_graph(self, *, blocking: bool, key: tuple[str, str]) -> "compiled.CompiledCalls | None":
        """The compiled graph the call of `key` (role, method) may take now, or None for the plain
        path (compiled.py)."""
        if not self._graph_allowed:
            return None
        self.compiled_outstanding = [f for f in self.compiled_outstanding if not f.done()]
        if self.compiled_outstanding and self._graph is not None and self._graph.usable:
            return self._graph  # after compiled calls still running, to keep the order
        if self.outstanding:  # a plain call still queued or running on these processes goes first
            self.outstanding = [f for f in self.outstanding if not f.done()]
            if self.outstanding:
                return None
        if self._graph is None:
            if not blocking:  # compiled at a blocking call, after COMPILE_AFTER of them
                return None
            self._blocking_calls += 1
            if self._blocking_calls <= compiled.COMPILE_AFTER:
                return None
            try:
                self._graph = compiled.CompiledCalls(self.actors)
            except Exception as err:  # e.g. a cluster whose nodes cannot share channels
                import warnings

                warnings.warn(f"worker group {self.name!r}: compiled calls unavailable, every call takes the "
                              f"plain Ray path ({type(err).__name__}: {err})", RuntimeWarning, stacklevel=3)
                self._graph_allowed = False
                return None
        if not self._graph.usable:
            self._graph_allowed = False
            return None
        if self._graph_mode == "short" and self.last_compute_s.get(key, float("inf")) >= compiled.SHORT_CALL_S:
            return None
        return self._graph

    def shutdown(self) -> None:
        import ray

        if self._graph is not None:
            self._graph.teardown()
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=5)
        except Exception:  # a dead or stuck rank must not stop the others from being killed
            pass
        for a in self.actors:
            ray.kill(a)


class RayWorkerGroup:
    """Driver-side view of one role on a HostSet; registered methods are bound by name."""

    def __init__(self, pool: ResourcePool, cls: type, *, name: str | None = None, args: tuple = (),
                 kwargs: dict | None = None, env: dict[str, str] | None = None,
                 timeout: float | None = None, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 _hosts: HostSet | None = None, _role: str | None = None):
        self.name = name or cls.__name__
        self.role = _role or self.name
        self.cls = cls
        self.default_timeout = timeout
        self.hosts = _hosts or HostSet(pool, name=self.name, env=env, collective_timeout_s=collective_timeout_s)
        self.hosts.join()
        refs = [(RankInfo(r, r, self.world_size, True), a.add_role.remote(self.role, cls, args, kwargs or {}))
                for r, a in enumerate(self.hosts.actors)]
        per_rank = [infos for _, infos in _wait_all(refs, timeout=timeout, what=self._what("__init__"))]
        # mesh name -> RankInfo of every rank, in rank order
        self.rank_infos = {name: [infos[name] for infos in per_rank] for name in per_rank[0]}
        self._bind_methods()
        startup.mark("roles (engines, vLLM)")

    @classmethod
    def colocated(cls, pool: ResourcePool, roles: dict[str, RoleSpec], *, name: str = "colocated",
                  env: dict[str, str] | None = None, timeout: float | None = None,
                  collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                  hosts: HostSet | None = None) -> dict[str, "RayWorkerGroup"]:
        """Several roles in one process per rank (the hybrid engine); one group handle per role.
        `hosts`: processes already started on `pool` (HostSet(..., join=False)) to use."""
        if not roles:
            raise ValueError("colocated() needs at least one role")
        hosts = hosts or HostSet(pool, name=name, env=env, collective_timeout_s=collective_timeout_s)
        return {
            role: cls(pool, spec.cls, name=name, args=spec.args, kwargs=spec.kwargs, timeout=timeout,
                      _hosts=hosts, _role=role)
            for role, spec in roles.items()
        }

    @property
    def world_size(self) -> int:
        return self.hosts.world_size

    def _what(self, method: str) -> str:
        return f"worker group {self.name!r} role {self.role!r} method {method!r}"

    def _bind_methods(self) -> None:
        self._registrations = registered_methods(self.cls)  # looked up once, not on every call
        for method in self._registrations:
            if hasattr(type(self), method):
                raise ValueError(
                    f"{self.cls.__name__}.{method} is registered but the name is taken by the worker "
                    "group itself; rename the method"
                )
            bound = functools.partial(self.call, method)
            functools.update_wrapper(bound, getattr(self.cls, method))
            setattr(self, method, bound)

    def call(self, method: str, *args, blocking: bool | None = None, timeout: float | None = None, **kwargs):
        """Split args per the method's dispatch mode, call every rank, gather the outputs."""
        reg = self._registrations.get(method)
        if reg is None:
            raise AttributeError(f"{self.cls.__name__}.{method} is not a registered method")
        mode = get_dispatch_mode(reg.dispatch)
        if reg.mesh not in self.rank_infos:
            raise ValueError(f"{self.cls.__name__}.{method} is registered on mesh {reg.mesh!r}, but the "
                             f"worker declared only {sorted(self.rank_infos)}; call set_mesh(..., name={reg.mesh!r})")
        infos = self.rank_infos[reg.mesh]
        t0, tracer = time.perf_counter(), trace.current()
        submitted = time.time() if tracer is not None else 0.0
        split = mode.split(args, kwargs, infos)
        is_blocking = reg.blocking if blocking is None else blocking
        limit = self.default_timeout if timeout is None else timeout
        graph = self.hosts.compiled_graph(blocking=is_blocking, key=(self.role, method))
        if graph is not None:
            fut = self._call_compiled(graph, method, mode, infos, split, timeout=limit, t0=t0, tracer=tracer,
                                      submitted=submitted)
            if not is_blocking:
                self.hosts.compiled_outstanding.append(fut)
            return fut.get() if is_blocking else fut
        per_rank = transport.put_shared(split)
        stamp = () if tracer is None else (True,)  # a traced call's ranks return their own start and end
        calls = [
            (info, actor.call.remote(self.role, method, *call, info.collect or not mode.collect_ranks_only, *stamp))
            for info, actor, call in zip(infos, self.hosts.actors, per_rank)
            if call is not None
        ]
        record = self._record(method, t0)
        self._trace(record, tracer, infos, split, submitted=submitted, compiled=False)
        fut = GroupFuture(calls=calls, collect=mode.collect, what=self._what(method), timeout=limit, record=record,
                          zero_copy=mode.copies_outputs, hosts=None if is_blocking else self.hosts)
        return fut.get() if is_blocking else fut

    def _record(self, method: str, t0: float) -> CallRecord:
        """The record of a call whose submission started at `t0`; its compute time, once gathered,
        is kept as the method's last duration (HostSet.last_compute_s)."""
        return CallRecord(self.name, method, time.perf_counter() - t0, 0.0, 0.0, 0.0, (self.role, method),
                          self.hosts.last_compute_s)

    def _trace(self, record: CallRecord, tracer, infos: list[RankInfo], split: list, *, submitted: float,
               compiled: bool) -> None:
        """trainer.trace: the call joins the run's timeline once its ranks answer (`_gathered`)."""
        if tracer is None:
            return
        record.trace = tracer.begin_call(
            group=self.name, role=self.role, method=record.method, submitted=submitted, compiled=compiled,
            bytes_in={info.rank: transport.payload_bytes(call) for info, call in zip(infos, split) if call is not None})

    def _call_compiled(self, graph: compiled.CompiledCalls, method: str, mode, infos: list[RankInfo], split: list,
                       *, timeout: float | None, t0: float, tracer=None, submitted: float = 0.0) -> "CompiledFuture":
        """A call through the processes' compiled graph (compiled.py); same result and errors."""
        stamp = () if tracer is None else (True,)
        payloads = [None if call is None else
                    compiled.encode((self.role, method, *call, info.collect or not mode.collect_ranks_only, *stamp))
                    for info, call in zip(infos, transport.inline_or_put(split))]
        record = self._record(method, t0)
        self._trace(record, tracer, infos, split, submitted=submitted, compiled=True)
        try:
            refs = graph.submit(payloads)
        except compiled.CompiledCallError as err:
            raise WorkerDiedError(f"{self._what(method)}: a rank's process died or its channel closed ({err})") from err
        return CompiledFuture(graph=graph, refs=refs, payloads=payloads, infos=infos, collect=mode.collect,
                              what=self._what(method), timeout=timeout, record=record, zero_copy=mode.copies_outputs)

    def shutdown(self) -> None:
        """Stop every process of this group (and of roles colocated with it)."""
        self.hosts.shutdown()
