"""Executor: run a resharding `Plan` on torch.distributed, one bounded bucket at a time.

Dataflow per bucket (every rank runs the same loop over the same buckets):

1. pack: pieces that are one contiguous run of the local shard (dim-0 slices: FSDP shards,
   column-parallel splits) are sent straight from it; the strided ones (row-parallel column blocks)
   for peer q are copied into one flat byte buffer per peer;
2. move: all isends and irecvs of the bucket are issued together with `dist.batch_isend_irecv`
   (gloo on CPU, NCCL on GPU);
3. stream: the consumer gets `(name, Box, tensor)` pieces for this rank, in global coordinates:
   received pieces are views into the receive buffers, reused pieces are views of the local training
   shard itself (no second copy). All buffers are carved from one arena, sized for this rank's
   largest bucket and reused by every bucket, so the extra memory held is at most one bucket.

The executor measures its own accounting (`ReshardStats`): payload bytes sent/received, bytes reused
in place, peak extra bytes held in buffers, buckets and wall time.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from rlframe.resharding.box import Box
from rlframe.resharding.delta import HEADER_WORDS, DeltaState
from rlframe.resharding.planner import Plan, Transfer, aligned, make_buckets

Piece = tuple[str, Box, torch.Tensor]
Consumer = Callable[[list[Piece]], None]


@dataclass
class ReshardStats:
    """What one rank did in one reshard (measured while executing, not taken from the plan)."""

    rank: int
    bytes_sent: int = 0
    bytes_sent_zero_copy: int = 0  # part of bytes_sent that went straight from the shard, unpacked
    bytes_received: int = 0
    bytes_reused: int = 0
    peak_extra_bytes: int = 0
    num_buckets: int = 0
    num_messages: int = 0
    time_s: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _layout(pieces: list[Transfer], plan: Plan) -> tuple[list[tuple[Transfer, int, int]], int]:
    """Byte offset and size of each piece in a flat buffer (offsets aligned for `.view(dtype)`)."""
    out, off = [], 0
    for p in pieces:
        n = p.box.numel * plan.params[p.name].itemsize
        out.append((p, off, n))
        off += aligned(n)
    return out, off


def _local_view(plan: Plan, local: Mapping[str, torch.Tensor], name: str, box: Box, rank: int) -> torch.Tensor:
    held = plan.src_boxes[(name, rank)]
    t = local[name]
    assert tuple(t.shape) == held.sizes, (name, tuple(t.shape), held)
    return t[box.relative_to(held).slices()]


def _typed(buf: torch.Tensor, off: int, n: int, plan: Plan, p: Transfer) -> torch.Tensor:
    return buf[off:off + n].view(plan.params[p.name].dtype).view(p.box.sizes)


def _split_bucket(bucket: list[Transfer], rank: int) -> tuple[dict, dict]:
    """This rank's remote pieces of a bucket, by peer: (sends {dst: pieces}, recvs {src: pieces})."""
    sends: dict[int, list[Transfer]] = {}
    recvs: dict[int, list[Transfer]] = {}
    for p in bucket:
        if p.local:
            continue
        if p.src == rank:
            sends.setdefault(p.dst, []).append(p)
        if p.dst == rank:
            recvs.setdefault(p.src, []).append(p)
    return sends, recvs


def _contiguous_at_source(plan: Plan, p: Transfer) -> bool:
    """Whether piece `p` is one contiguous run of its sender's (row-major, contiguous) local shard.

    Such pieces are sent straight from the shard with no packing copy. Both sides decide this from
    the plan alone, so sender and receiver agree on the messages without talking.
    """
    held = plan.src_boxes[(p.name, p.src)]
    rel = p.box.relative_to(held)
    partial = [d for d in range(len(held.sizes)) if rel.sizes[d] != held.sizes[d]]
    return not partial or all(rel.sizes[d] == 1 for d in range(partial[-1]))


def _direct(plan: Plan, p: Transfer, min_bytes: int) -> bool:
    """Send `p` straight from the shard: contiguous there and large enough to be worth a message."""
    return p.box.numel * plan.params[p.name].itemsize >= min_bytes and _contiguous_at_source(plan, p)


def _messages(pieces: list[Transfer], plan: Plan, min_bytes: int) -> list[list[Transfer]]:
    """One peer's pieces as messages: first all packed pieces together, then one per direct piece
    (sent zero-copy). Sender and receiver post them in this same order."""
    packed = [p for p in pieces if not _direct(plan, p, min_bytes)]
    return ([packed] if packed else []) + [[p] for p in pieces if _direct(plan, p, min_bytes)]


def _arena_bytes(buckets: list[list[Transfer]], plan: Plan, rank: int, min_bytes: int) -> int:
    """Largest buffer space this rank needs in any one bucket (packed sends + all receives)."""
    most = 0
    for bucket in buckets:
        sends, recvs = _split_bucket(bucket, rank)
        n = sum(_layout(m, plan)[1] for ps in sends.values() for m in _messages(ps, plan, min_bytes)
                if not _direct(plan, m[0], min_bytes))
        n += sum(_layout(ps, plan)[1] for ps in recvs.values())
        most = max(most, n)
    return most


def _word(msg: list[Transfer], plan: Plan) -> int:
    """The element size a delta sync compares a message in (its pieces' smallest)."""
    return min(plan.params[p.name].itemsize for p in msg)


def _post_sends(sends, plan, local, rank, arena, used, group, stats, min_bytes) -> tuple[list, int, list]:
    ops, words = [], []
    cast = 0  # bytes of the cast copies this bucket holds until its sends complete
    for peer in sorted(sends):
        for msg in _messages(sends[peer], plan, min_bytes):
            words.append(_word(msg, plan))
            if _direct(plan, msg[0], min_bytes):
                view = _local_view(plan, local, msg[0].name, msg[0].box, rank)
                dtype = plan.params[msg[0].name].dtype
                if view.dtype == dtype:
                    buf = view.reshape(-1).view(torch.uint8)
                    stats.bytes_sent_zero_copy += buf.numel()
                else:  # the plan's dtype is the sync's (fp32 shards sent as bf16): cast this piece alone
                    buf = view.to(dtype).reshape(-1).view(torch.uint8)
                    cast += buf.numel()
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes, arena.numel() + cast)
            else:
                placed, total = _layout(msg, plan)
                buf = arena[used:used + total]
                used += total
                for p, off, n in placed:
                    _typed(buf, off, n, plan, p).copy_(_local_view(plan, local, p.name, p.box, rank))
                    buf[off + n:off + aligned(n)].zero_()  # alignment gap: the same bytes at every sync
            stats.bytes_sent += sum(p.box.numel * plan.params[p.name].itemsize for p in msg)
            ops.append((True, buf, peer))  # the peer's rank in the plan's numbering
    return ops, used, words


def _post_recvs(recvs, plan, arena, used, group, stats, views, min_bytes) -> tuple[list, list]:
    ops, words = [], []
    for peer in sorted(recvs):
        for msg in _messages(recvs[peer], plan, min_bytes):
            words.append(_word(msg, plan))
            placed, total = _layout(msg, plan)
            buf = arena[used:used + total]
            used += total
            for p, off, n in placed:
                views[id(p)] = _typed(buf, off, n, plan, p)
                stats.bytes_received += n
            # A zero-copy send carries no alignment padding: receive exactly its bytes.
            if _direct(plan, msg[0], min_bytes):
                buf = buf[:placed[0][2]]
            ops.append((False, buf, peer))
    return ops, words


def _start(ops: list[tuple[bool, torch.Tensor, int]], group, channel) -> list:
    """Post a bucket's sends and receives together: on the channel between two groups, else with
    `batch_isend_irecv` on this group (P2POp takes global ranks, which plans are written in)."""
    if channel is not None:
        return channel.start(ops)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, buf, peer, group)
                                   for send, buf, peer in ops])


def _move(ops: list, group, channel) -> None:
    if ops:
        for req in _start(ops, group, channel):
            req.wait()


def _move_delta(ops: list, words: list[int], delta: DeltaState, bucket_index: int, group, channel) -> None:
    """The bucket's messages as deltas against the last sync (delta.py): every header first, then
    the payloads; a dense payload is received straight into its slot."""
    keys = [(bucket_index, send, peer, i) for i, (send, _, peer) in enumerate(ops)]
    heads, payloads = [], []
    for (send, buf, peer), key, word in zip(ops, keys, words):
        if send:
            head, payload = delta.encode(key, buf, word)
        else:
            head, payload = torch.empty(HEADER_WORDS, dtype=torch.int64, device=buf.device), None
        heads.append((send, head, peer))
        payloads.append(payload)
    _move(heads, group, channel)
    moves = []
    for (send, buf, peer), (_, head, _), payload, word in zip(ops, heads, payloads, words):
        if not send:
            payload = buf if delta.is_dense(head) else torch.empty(
                delta.payload_bytes(head, word), dtype=torch.uint8, device=buf.device)
        moves.append((send, payload, peer))
    _move([m for m in moves if m[1].numel()], group, channel)  # nothing changed: the header said all
    for (send, buf, _), (_, head, _), (_, payload, _), key, word in zip(ops, heads, moves, keys, words):
        if not send:
            delta.decode(key, head, payload, buf, word)


@dataclass(frozen=True)
class Relay:
    """A generation rank's place in a chain of replicas (fan-out, split placement): the plan covers
    the first replica only; this rank receives what the plan's rank `mirror` (the first replica's
    rank at its tp position) receives, in the same messages, from `upstream` (None: from the plan's
    senders: it is that rank), and forwards every message as received to `downstream` (None: last).
    The training ranks send each slice once, to the first replica; each replica passes it on while
    it receives the next bucket (two arenas on a forwarding rank)."""

    mirror: int
    upstream: int | None
    downstream: int | None


def _run_bucket(bucket: list[Transfer], plan: Plan, local, rank: int, arena: torch.Tensor, group, channel,
                stats: ReshardStats, min_bytes: int, delta: DeltaState | None = None,
                bucket_index: int = 0, relay: Relay | None = None) -> tuple[list[Piece], list]:
    """This rank's pieces of the bucket, and the requests of its forwards still in flight (a relay)."""
    # All buffers of a bucket are carved from one arena allocated once: no allocation or page
    # faults per bucket, and the arena's size is the executor's whole extra memory.
    sends, recvs = _split_bucket(bucket, rank)
    views: dict[int, torch.Tensor] = {}
    ops, used, words = _post_sends(sends, plan, local, rank, arena, 0, group, stats, min_bytes)
    received = stats.bytes_received
    recv_ops, recv_words = _post_recvs(recvs, plan, arena, used, group, stats, views, min_bytes)
    received = stats.bytes_received - received  # the pieces' bytes, without the messages' alignment padding
    if relay is not None and relay.upstream is not None:  # the same messages, from the previous replica
        recv_ops = [(False, buf, relay.upstream) for _, buf, _ in recv_ops]
    all_ops, words = ops + recv_ops, words + recv_words
    if delta is None:
        _move(all_ops, group, channel)
    else:
        _move_delta(all_ops, words, delta, bucket_index, group, channel)
    stats.num_messages += len(all_ops)
    in_flight = []
    if relay is not None and relay.downstream is not None and recv_ops:
        forwards = [(True, buf, relay.downstream) for _, buf, _ in recv_ops]
        stats.bytes_sent += received
        stats.num_messages += len(forwards)
        if delta is None:
            in_flight = _start(forwards, group, channel)
        else:  # re-encoded against this link's own copies
            _move_delta(forwards, recv_words, delta, bucket_index, group, channel)
    out = []
    for p in bucket:
        if p.dst != rank:
            continue
        if p.local:
            out.append((p.name, p.box, _local_view(plan, local, p.name, p.box, rank)))
            stats.bytes_reused += p.box.numel * plan.params[p.name].itemsize
        else:
            out.append((p.name, p.box, views[id(p)]))
    return out, in_flight


def execute_plan(plan: Plan, *, local: Mapping[str, torch.Tensor], consumer: Consumer,
                 bucket_bytes: int = 256 << 20, zero_copy_min_bytes: int = 1 << 20, group=None,
                 device: torch.device | str | None = None, channel=None,
                 delta: DeltaState | None = None, relay: Relay | None = None) -> ReshardStats:
    """Run `plan` on this rank; stream each bucket's pieces into `consumer`; return measured stats.

    local: {name: tensor} of this rank's source shards, shaped as `plan.src_boxes[(name, rank)]`
        (ranks outside the source layout pass {}); a shard whose dtype differs from the plan's is
        cast piece by piece as it is sent (the plan's dtype is what moves).
    consumer: called once per bucket that has pieces for this rank, with `[(name, box, tensor)]`;
        `box` is in global coordinates, `tensor` has shape `box.sizes`. Tensors are views into
        buffers reused after the call returns: copy what you keep.
    bucket_bytes: bound on the bytes a rank sends plus receives per bucket (the extra memory held).
    zero_copy_min_bytes: contiguous pieces at least this large are sent straight from the shard as
        their own message; smaller ones are packed with the others for that peer (fewer messages).
    channel: a `P2PChannel` joining two worker groups (ranks are then the channel's); None moves the
        pieces inside this process's torch.distributed world.
    delta: this rank's `DeltaState` (delta.py) to send only what changed since the last sync with
        the same state; every rank of the plan passes one (or none), kept from sync to sync.
    relay: a generation rank's place in a chain of replicas (`Relay`); the plan then covers the
        first replica only, on every rank.
    All ranks of `plan.ranks` must call this with the same plan and bucket_bytes.
    """
    own_rank = rank = dist.get_rank() if channel is None else channel.rank
    if relay is not None:  # a replica of the plan's destination rank `mirror`
        rank = relay.mirror
    if device is None:
        device = next(iter(local.values())).device if local else torch.device("cpu")
    missing = [n for (n, r) in plan.src_boxes if r == rank and n not in local]
    if missing:
        raise ValueError(f"rank {rank} holds {len(missing)} source shards it did not pass in `local`, e.g. {missing[:3]}")
    strided = [n for (n, r) in plan.src_boxes if r == rank and not local[n].is_contiguous()]
    if strided:
        raise ValueError(f"local shards must be contiguous (pieces are sent straight from them); "
                         f"call .contiguous() on {strided[:3]}")
    stats = ReshardStats(rank=own_rank)
    t0 = time.perf_counter()
    buckets = make_buckets(plan, bucket_bytes=bucket_bytes)
    stats.num_buckets = len(buckets)
    size = _arena_bytes(buckets, plan, rank, zero_copy_min_bytes)
    # The arenas are the only extra memory the executor allocates; reused pieces alias the local shards.
    # A forwarding relay receives the next bucket into a second arena while the first one is sent on.
    forwarding = relay is not None and relay.downstream is not None and delta is None
    arenas = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2 if forwarding else 1)]
    stats.peak_extra_bytes = size * len(arenas)
    assert size <= bucket_bytes, (size, bucket_bytes)
    if channel is None and dist.get_backend(group) == "nccl":
        # NCCL: a batched p2p call must not be the first collective of the group (torch docs).
        dist.barrier(group=group)
    if delta is not None:
        delta.begin_sync()
    in_flight: list[list] = [[] for _ in arenas]
    done = 0
    for index, bucket in enumerate(buckets):
        if not any(rank in (p.src, p.dst) for p in bucket):
            continue
        slot = done % len(arenas)
        for req in in_flight[slot]:  # the forwards still reading this arena
            req.wait()
        pieces, in_flight[slot] = _run_bucket(bucket, plan, local, rank, arenas[slot], group, channel, stats,
                                              zero_copy_min_bytes, delta=delta, bucket_index=index, relay=relay)
        done += 1
        if pieces:
            consumer(pieces)
    for reqs in in_flight:
        for req in reqs:
            req.wait()
    del arenas
    stats.time_s = time.perf_counter() - t0
    return stats


def assemble(pieces_by_name: Mapping[str, list[Piece]], boxes: Mapping[str, Box]) -> dict[str, torch.Tensor]:
    """Glue pieces into one tensor per name covering `boxes[name]` (a test/consumer convenience)."""
    out = {}
    for name, box in boxes.items():
        pieces = pieces_by_name.get(name, [])
        assert pieces, f"no pieces for {name}"
        t = torch.empty(box.sizes, dtype=pieces[0][2].dtype, device=pieces[0][2].device)
        for _, b, x in pieces:
            t[b.relative_to(box).slices()] = x
        out[name] = t
    return out


class ShardAssembler:
    """Consumer adapter: turns streamed pieces into one tensor per parameter covering its whole box.

    `ShardAssembler(boxes, on_complete)` is itself a consumer for `execute_plan`. A piece that already
    covers its parameter's box is passed through untouched (no copy; still a view into the executor's
    buffers or the local shard); otherwise pieces are copied into a tensor of the box's size that is
    handed on, once complete, as `(name, box, tensor)`. `on_complete` gets the parameters completed by
    each bucket (as a list), so fused formats (vLLM's qkv_proj) can be built from whole shards.
    Extra memory: the partially filled parameters (at most the ones split across a bucket boundary).
    """

    def __init__(self, boxes: Mapping[str, Box], on_complete: Consumer):
        self.boxes = dict(boxes)
        self.on_complete = on_complete
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}

    def __call__(self, pieces: list[Piece]) -> None:
        done = []
        for name, box, t in pieces:
            whole = self.boxes[name]
            if box == whole:
                done.append((name, box, t))
                continue
            buf, filled = self._partial.get(name) or (torch.empty(whole.sizes, dtype=t.dtype, device=t.device), 0)
            buf[box.relative_to(whole).slices()] = t
            filled += box.numel
            if filled == whole.numel:
                del self._partial[name]
                done.append((name, whole, buf))
            else:
                self._partial[name] = (buf, filled)
        if done:
            self.on_complete(done)

    @property
    def pending(self) -> list[str]:
        """Parameters with some but not all pieces received (empty after a complete reshard)."""
        return sorted(self._partial)
