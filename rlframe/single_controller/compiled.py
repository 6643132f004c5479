"""The compiled call path: one Ray compiled graph per set of worker processes, for short calls.

A plain group call submits one Ray actor task per rank: about 0.2-0.3 ms of driver time each, and
every process wakes its gRPC threads to receive it; on 8 ranks sharing 2 cores a no-op call took
3.6-4.7 ms. A Ray compiled graph (`ray.dag`) sets up shared-memory channels once: a call then
writes the per-rank payloads into one input channel and reads one output channel per rank, about
1 ms for 8 ranks (docs/benchmarks.md, "Controller call overhead").

When a call takes it (`RayWorkerGroup.call`): once the processes have served `COMPILE_AFTER`
blocking calls (a group used once or twice never pays the 0.2-0.5 s compile), a call, blocking or
not, whose method took under SHORT_CALL_S the last time it was called, while no plain non-blocking
call on the same processes is outstanding. Longer calls stay plain because the driver's wait on a
compiled call is a busy poll: 2.9 s of driver CPU during a 3 s call (a plain call's wait: 0.01 s),
a core taken from the workers on a 2-core machine.

Order: Ray runs one actor's plain calls in submission order on its main thread; a compiled call
runs on Ray's system thread of the actor and would overtake a plain call still queued there (ranks
could then enter collectives in different orders), hence the wait for outstanding plain calls.
Compiled calls run in submission order among themselves, so a call made while compiled calls are
still outstanding is compiled too, whatever its length, and calls issued together
(`blocking=False`) behave as on the plain path.

Payload of a rank: `(role, method, args, kwargs, collect)` (with `True` after it in a traced run)
pickled by the driver (ObjectRefs set aside and sent natively beside the bytes), the numbers of the
calls whose stored answers the rank may let go (settled since its last payload) and the number of
this call, or None where the rank is not called; the answer is `(output, seconds)` (traced: with the
rank's start, end and spans, WorkerHost.call) pickled by the rank, or an object-store reference to
it above OUTPUT_INLINE_BYTES, which the rank holds under the call's number until the driver has
settled that call (`answer`): fetched its answers, or seen it fail on some rank. Ray drops the other
ranks' answers of a call that raised on one rank, so the driver cannot name those by their ids.
Pickling in-band means nothing either side keeps aliases a channel's shared memory: Ray deserializes
numpy buffers from a channel without copying, and an array kept from one call pins the channel so
that the next call cannot be written (it hangs). Every rank reads the whole input, so DataProtos go
inline only while all of them together are small (`transport.INLINE_BYTES`); otherwise each
distinct DataProto is put into the object store once and only its ranks fetch it.

Failures: a rank that raises is reported at once, by rank (Ray reads the output channels in turn
and returns on the first error; the other ranks' outputs of that call are read before the next
one). A rank that dies, or a call that outlives its timeout, leaves the graph unusable: it is
dropped and later calls take the plain path, which names the dead rank.

`RLFRAME_COMPILED_CALLS=0` turns the path off (every call plain), `=all` compiles every call.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
from typing import Any

# Blocking calls a set of processes serves on the plain path before its graph is compiled.
COMPILE_AFTER = 2
# A rank's answer larger than this goes through the object store instead of its output channel
# (a channel keeps the size of the largest message it carried).
OUTPUT_INLINE_BYTES = 4 * 1024 * 1024
# A method whose last call took longer than this (the slowest rank's time inside it) goes plain.
SHORT_CALL_S = 0.05


def mode() -> str:
    """RLFRAME_COMPILED_CALLS: "short" (default) for calls whose method last took under SHORT_CALL_S,
    "all" for every call, "off" (or 0) for none."""
    value = os.environ.get("RLFRAME_COMPILED_CALLS", "short").strip().lower()
    if value in ("0", "false", "no", "off"):
        return "off"
    return "all" if value == "all" else "short"


class CompiledCallError(RuntimeError):
    """The compiled graph failed as a whole (a process died, a channel broke, a timeout)."""


class CompiledCalls:
    """One compiled graph over `actors` (WorkerHost handles, index = rank): input i is rank i's payload."""

    def __init__(self, actors: list):
        import ray
        from ray.dag import InputNode, MultiOutputNode

        # Ray logs every teardown step at INFO on the driver's console; a run's output keeps its own lines.
        logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)
        self.pid_to_rank = {pid: rank for rank, pid in enumerate(ray.get([a.pid.remote() for a in actors]))}
        with InputNode() as inp:
            dag = MultiOutputNode([a.call_packed.bind(inp[i]) for i, a in enumerate(actors)])
        self.graph = dag.experimental_compile()
        self.usable = True
        self._calls = 0  # the number of the last call submitted
        # per rank: the calls whose stored answers the rank may let go, for its next payload
        self._settled: dict[int, list[int]] = {}

    def submit(self, payloads: list) -> "CallRefs":
        """Start one call (the ranks run it in submission order); its CompiledDAGRefs, one per rank.
        A called rank's payload also carries the calls settled since its last one, and this call's
        number (`answer`)."""
        self._calls += 1
        payloads = [None if p is None else (*p, self._settled.pop(rank, []), self._calls)
                    for rank, p in enumerate(payloads)]
        try:
            return CallRefs(self.graph.execute(*payloads), self._calls,
                            called=[rank for rank, p in enumerate(payloads) if p is not None])
        except Exception as err:  # a closed channel, a dead process
            self.usable = False
            raise CompiledCallError(f"{type(err).__name__}: {err}") from err

    def _settle(self, call: int, ranks) -> None:
        """`ranks` may let their stored answers of `call` go (named in their next payloads)."""
        for rank in ranks:
            self._settled.setdefault(rank, []).append(call)

    def collect(self, refs: list, *, timeout: float | None) -> list[Any]:
        """Each rank's answer to a submitted call, decoded (None where the payload was None); raises
        RayTaskError for a rank that raised (see `failed_rank`), CompiledCallError when the graph
        itself failed (it is then unusable)."""
        import ray
        from ray.exceptions import RayTaskError

        try:
            wait = -1 if timeout is None else max(timeout, 1e-3)
            answers = [ref.get(timeout=wait) for ref in refs]
        except RayTaskError:  # Ray drops the other ranks' answers: every rank lets this call's go
            self._settle(refs.call, refs.called)
            raise
        except Exception as err:  # RayChannelError (timeouts, closed channels), dead processes
            self.usable = False
            raise CompiledCallError(f"{type(err).__name__}: {err}") from err
        stored = [i for i, a in enumerate(answers) if isinstance(a, ray.ObjectRef)]
        try:
            for i, value in zip(stored, ray.get([answers[i] for i in stored])):
                answers[i] = value
        finally:  # fetched, or lost for good: held no longer either way
            self._settle(refs.call, stored)
        return [pickle.loads(a) if isinstance(a, bytes) else a for a in answers]

    def failed_rank(self, err) -> int | None:
        """The rank whose method raised `err` (a RayTaskError), from its process id: an attribute of
        a plain RayTaskError; one that is also of its cause's type (as the graph raises them) keeps
        it only in its text, "(pid=..., ip=...)"."""
        pid = getattr(err, "pid", None)
        if pid is None:
            found = re.search(r"\(pid=(\d+),", str(err))
            pid = int(found.group(1)) if found else None
        return self.pid_to_rank.get(pid)

    def teardown(self) -> None:
        """Stop the graph's loops in the processes; a graph that failed is left for ray.kill."""
        if self.usable:
            try:
                self.graph.teardown()
            except Exception:  # a process that died meanwhile: the actors are killed next anyway
                pass
        self.usable = False


class CallRefs(list):
    """A submitted call's CompiledDAGRefs, one per rank, its number (`call`) and the ranks called."""

    def __init__(self, refs, call: int, *, called: list[int]):
        super().__init__(refs)
        self.call, self.called = call, called


def encode(obj) -> tuple[bytes, list]:
    """`obj` pickled in-band with its ObjectRefs set aside (they travel natively beside the bytes)."""
    import ray

    refs: list = []

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, ray.ObjectRef):
                refs.append(o)
                return len(refs) - 1
            return None

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue(), refs


def decode(data: bytes, refs: list):
    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            return refs[pid]

    return _Unpickler(io.BytesIO(data)).load()


def answer(value, held: dict, call: int):
    """A rank's answer to call number `call`: pickled bytes, or a reference to the object store when
    large.

    The rank owns what it puts, and a reference that leaves through a channel is not counted as
    the driver's borrow: were the rank to drop it, Ray could delete the object before the driver
    fetches it ("already deleted by the reference counting protocol"). So the rank holds it in
    `held` under `call` until the driver names the call as settled (a later payload, `release`)."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= OUTPUT_INLINE_BYTES:
        return data
    import ray

    ref = ray.put(value)
    held[call] = ref
    return ref


def release(held: dict, settled: list[int]) -> None:
    """Let go of the stored answers of the calls the driver has settled (fetched, or failed)."""
    for call in settled:
        held.pop(call, None)
