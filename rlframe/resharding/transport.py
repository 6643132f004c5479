"""Transports the resharding executor posts its messages on, between two worker groups.

A transport moves byte buffers between ranks of a channel (the training group's ranks first, then
the generation group's: `P2PChannel` in channel.py) and has one method:

    start(ops: [(is_send, uint8 tensor, peer)]) -> [request with .wait()]

Messages between one pair of ranks are matched in the order they are posted, on every transport.

- gloo: point-to-point over TCP (ProcessGroupGloo), any pair of hosts.
- shm: for two ranks on one host: each sender -> receiver pair has a ring in shared memory (a file
  in /dev/shm both map, reserved with fallocate so that a full /dev/shm is an error at the send, not
  a crash at a page fault); the sender copies a message into the ring, the receiver copies it out
  into its buffer; the channel's TCP store carries only "message k is at offset o" and the count of
  messages read, which frees ring space. The ring grows (a new, larger file) when a message does not
  fit, up to a bound (half of `ring_room`: two buckets); past it the sender waits for its receiver to
  read, as a send waits on a socket's full buffer, reading meanwhile whatever was sent to it (two ranks
  sending to each other both make progress). A sender that fails tells its receivers, which raise
  instead of waiting for the rest.
- file: one safetensors file per message in a directory on shared storage (a standard container with
  its sender, receiver and sequence number in the header), for engines outside the job; only the
  small "it is there" signals use the channel's store.
- nccl: ProcessGroupNCCL between GPUs, the same construction as gloo; written for GPU clusters and
  not runnable in this CPU build (torch.distributed.is_nccl_available() is False): choosing it here
  is refused with that reason.
- auto: chosen per pair of ranks by locality: shm between two ranks on one host (the same address
  toward the channel's store, and each sees the other's probe file in /dev/shm with room there for
  the rings), gloo otherwise. Measured on a 2-core gVisor host (benchmarks/weight_sync.py), the shm
  rings move a sync faster than gloo over loopback; see docs/benchmarks.md.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# rollout.weight_transport: how split placement's weight channel moves bytes
WEIGHT_TRANSPORTS = ("auto", "gloo", "shm", "file", "nccl")

SHM_ROOT = "/dev/shm"
MIN_RING = 1 << 20
FLUSH_BYTES = 8 << 20  # a sender tells its receiver where its messages are every this many bytes


class _Done:
    def wait(self) -> None:
        return None


class ProcessGroupTransport:
    """gloo or NCCL point-to-point: a process group of all channel ranks, outside the default world."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta, *, backend: str):
        prefix = dist.PrefixStore(f"rlframe-weights-{backend}", store)
        if backend == "nccl":
            if not dist.is_nccl_available():
                raise ValueError("rollout.weight_transport=nccl needs a CUDA build of torch with NCCL "
                                 "(torch.distributed.is_nccl_available() is False here); use auto, gloo or shm")
            self._pg = dist.ProcessGroupNCCL(prefix, rank, world_size)
        else:
            self._pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)

    def start(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        # gloo pairs are FIFO per tag, as batch_isend_irecv is
        return [(self._pg.send if is_send else self._pg.recv)([buf], peer, 0) for is_send, buf, peer in ops]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as uint8 (messages may be typed: the delta headers are int64)."""
    return t.reshape(-1).view(torch.uint8)


class _FileReceive:
    def __init__(self, transport: "FileTransport", buf: torch.Tensor, peer: int, seq: int):
        self.t, self.buf, self.peer, self.seq = transport, _as_bytes(buf), peer, seq

    def wait(self) -> None:
        t = self.t
        key = t.key(self.peer, t.rank, self.seq)
        t.store.wait([key], t.timeout)
        path = t.path(self.peer, t.rank, self.seq)
        from safetensors.torch import load_file

        data = load_file(path)["message"]
        if data.numel() != self.buf.numel():
            raise ValueError(f"{path}: a message of {data.numel()} bytes for a {self.buf.numel()}-byte buffer")
        self.buf.copy_(data)
        os.unlink(path)
        t.store.delete_key(key)


class FileTransport:
    """Messages as safetensors files in `directory` (storage every rank mounts); see the module
    docstring. Files are written under a temporary name and renamed, so a reader never sees half of one."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta, *, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.store, self.rank, self.timeout, self.directory = store, rank, timeout, directory
        self._sent: dict[int, int] = {}  # peer -> messages sent to it
        self._received: dict[int, int] = {}

    def key(self, src: int, dst: int, seq: int) -> str:
        return f"msg/{src}/{dst}/{seq}"

    def path(self, src: int, dst: int, seq: int) -> str:
        return os.path.join(self.directory, f"{src}-{dst}-{seq}.safetensors")

    def start(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        out = []
        for is_send, buf, peer in ops:
            counter = self._sent if is_send else self._received
            seq = counter.get(peer, 0)
            counter[peer] = seq + 1
            if not is_send:
                out.append(_FileReceive(self, buf, peer, seq))
                continue
            path = self.path(self.rank, peer, seq)
            tmp = path + ".tmp"
            try:
                from safetensors.torch import save_file

                save_file({"message": _as_bytes(buf.contiguous())}, tmp,
                          metadata={"src": str(self.rank), "dst": str(peer), "seq": str(seq)})
            except OSError as err:
                self.close()
                raise OSError(err.errno, f"weight transport: writing a {buf.numel() * buf.element_size()}-byte "
                                         f"message to {self.directory} failed ({err.strerror}); a bucket's messages "
                                         "are there at once: give it room for rollout.bucket_bytes, lower "
                                         "bucket_bytes, or use rollout.weight_transport=gloo") from err
            os.replace(tmp, path)
            self.store.set(self.key(self.rank, peer, seq), "1")
            out.append(_Done())
        return out

    def close(self) -> None:
        """Remove what is left of this rank's messages (a failed sync); the directory if empty."""
        for name in os.listdir(self.directory) if os.path.isdir(self.directory) else []:
            if name.startswith(f"{self.rank}-") or name.split("-")[1:2] == [str(self.rank)]:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass
        try:
            os.rmdir(self.directory)
        except OSError:
            pass


class _Ring:
    """One sender -> receiver ring of `size` bytes, mapped from the file `path`. The receiver removes the
    file once it has mapped it: the memory lives as long as either mapping, so a killed job leaves
    nothing in /dev/shm but a ring nobody has read yet."""

    def __init__(self, path: str, size: int, *, create: bool):
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # reserve now: a full /dev/shm fails here, not at a page fault
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
            os.close(fd)
        self.path, self.size = path, size
        self.data = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        if not create:
            os.unlink(path)


class _RingReceive:
    def __init__(self, transport: "ShmTransport", buf: torch.Tensor, peer: int, seq: int):
        self.t, self.buf, self.peer, self.seq, self.done = transport, _as_bytes(buf), peer, seq, False

    def wait(self) -> None:
        pending = self.t.pending[self.peer]
        while not self.done:  # a pair's messages are read in order: earlier receives first
            pending[0]._read()
            pending.pop(0)

    def _read(self, blocking: bool = True) -> bool:
        """Copy the message out (False, without blocking, when its sender has not said where it is yet)."""
        t, src = self.t, self.peer
        known = t.known.setdefault(src, {})
        while self.seq not in known:  # the next batch of this sender's messages ("where they are")
            key = f"ring/{src}/{t.rank}/b{t.fetched.get(src, 0)}"
            if not blocking and not t.store.check([key]):
                return False
            t.fetched[src] = t.fetched.get(src, 0) + 1
            for desc in t.store.get(key).decode().split(";"):  # get waits for the key
                if desc.startswith("error "):
                    raise RuntimeError(f"weight transport shm: rank {src} failed while sending to rank {t.rank}: "
                                       f"{desc[len('error '):]}")
                seq, gen, size, off, n = map(int, desc.split())
                known[seq] = gen, size, off, n
            t.store.delete_key(key)
        gen, size, off, n = known.pop(self.seq)
        if n != self.buf.numel():
            raise ValueError(f"weight transport shm: a message of {n} bytes from rank {src} for a "
                             f"{self.buf.numel()}-byte buffer (message {self.seq})")
        if n:
            ring = t.mapped.get(src)
            if ring is None or ring[0] != gen:  # the sender moved to a larger ring (it never goes back)
                ring = t.mapped[src] = (gen, _Ring(t.path(src, t.rank, gen), size, create=False))
            self.buf.copy_(ring[1].data[off:off + n])
        self.done = True
        t.unacked[src] = t.unacked.get(src, 0) + 1
        if not known:  # this batch is read: its ring space is free again
            t.store.add(f"ring/{src}/{t.rank}/read", t.unacked.pop(src))
        return True


class _SendRing:
    """The sender's side of one pair: the current ring, where the next message goes, and the messages
    the receiver has not read yet ([(seq, offset, bytes)] in the current ring, oldest first)."""

    def __init__(self):
        self.ring: _Ring | None = None
        self.gen, self.head, self.sent = -1, 0, 0
        self.unread: list[tuple[int, int, int]] = []
        self.made: list[str] = []  # the rings' files, removed by the receiver as it maps them

    def offset_for(self, n: int) -> int | None:
        """Where `n` bytes fit without touching an unread message; None if nowhere."""
        if self.ring is None:
            return None
        if not self.unread:
            return 0 if n <= self.ring.size else None
        tail = self.unread[0][1]
        if self.head > tail:  # unread [tail, head): free [head, size) and [0, tail)
            if self.head + n <= self.ring.size:
                return self.head
            return 0 if n < tail else None  # strictly: the head never catches up with the tail
        return self.head if self.head + n < tail else None  # wrapped: free [head, tail)


class ShmTransport:
    """Messages through shared-memory rings between ranks on one host; see the module docstring."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta, *, prefix: str,
                 max_ring: int = 512 << 20):
        self.store, self.rank, self.timeout, self.prefix = store, rank, timeout, prefix
        self.max_ring = max_ring  # a ring grows to this (or one message) at most; then its sender waits
        self._send: dict[int, _SendRing] = {}
        self._received: dict[int, int] = {}
        self._where: dict[int, list] = {}  # receiver -> [descriptors of this call's messages not posted, bytes]
        self.pending: dict[int, list[_RingReceive]] = {}  # sender -> receives posted, not read yet
        self.known: dict[int, dict] = {}  # sender -> {seq: (generation, ring size, offset, bytes)} not read yet
        self.fetched: dict[int, int] = {}  # sender -> batches of descriptors read from the store
        self.posted: dict[int, int] = {}  # receiver -> batches of descriptors put in the store
        self.unacked: dict[int, int] = {}  # sender -> messages read and not yet counted in its "read" key
        self.mapped: dict[int, tuple[int, _Ring]] = {}  # sender -> (generation, ring) being read
        atexit.register(self.close)

    def path(self, src: int, dst: int, gen: int) -> str:
        return f"{self.prefix}-{src}-{dst}-{gen}.ring"

    def _reclaim(self, peer: int, s: _SendRing) -> None:
        read = int(self.store.add(f"ring/{self.rank}/{peer}/read", 0))
        s.unread = [u for u in s.unread if u[0] >= read]

    def _place(self, peer: int, s: _SendRing, n: int) -> int:
        """An offset for `n` bytes in the ring to `peer`: where they fit beside its unread messages; else a
        larger ring while the ring is under max_ring (a message larger than that gets a ring of its own
        size once the receiver has read everything); else, like a socket's full buffer, the sender waits
        for its receiver to read (this call's descriptors posted first, so that it can)."""
        off = s.offset_for(n)
        if off is None and s.unread:
            self._reclaim(peer, s)
            off = s.offset_for(n)
        if off is not None:
            return off
        size = max(MIN_RING, 2 * n, 2 * (s.ring.size if s.ring else 0))
        if size > self.max_ring and s.ring is not None:
            if n <= s.ring.size:
                return self._wait_for_room(peer, s, n)
            self._wait_for_room(peer, s, 0)  # everything read: a ring for this message alone
            size = n
        try:  # a new ring: unread messages stay in the old one, which the receiver has mapped or will
            ring = _Ring(self.path(self.rank, peer, s.gen + 1), size, create=True)
        except OSError as err:
            raise OSError(err.errno, f"weight transport shm: reserving a {size}-byte ring in {SHM_ROOT} for "
                                     f"messages to rank {peer} failed ({err.strerror}); give /dev/shm room (a "
                                     "container's --shm-size), lower rollout.bucket_bytes, or use "
                                     "rollout.weight_transport=gloo") from err
        s.ring, s.gen, s.unread = ring, s.gen + 1, []
        s.made.append(ring.path)
        return 0

    def _wait_for_room(self, peer: int, s: _SendRing, n: int) -> int:
        """Post what this call wrote to `peer` so far, then poll its read count until `n` bytes fit (n = 0:
        until it has read everything)."""
        if peer in self._where:
            self._post(peer, self._where.pop(peer)[0])
        deadline, pause = time.monotonic() + self.timeout.total_seconds(), 1e-4
        while True:
            self._progress()  # the receiver may itself be waiting for this rank to read: read what is there
            self._reclaim(peer, s)
            off = s.offset_for(n) if n else (0 if not s.unread else None)
            if off is not None:
                return off
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight transport shm: rank {peer} has not read its messages from rank "
                                   f"{self.rank} within {self.timeout.total_seconds():.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)

    def _progress(self) -> None:
        """Read every posted receive whose message is there, in each sender's order, without blocking."""
        for pending in self.pending.values():
            while pending and pending[0]._read(blocking=False):
                pending.pop(0)

    def start(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        """Sends are copied into the rings now; each peer gets a store entry saying where its messages are
        per FLUSH_BYTES of them and at the end (a store round trip per message would cost more than the
        copies; one per call would keep the receiver from copying out while the sender copies in). If a
        send fails, every peer of this call is told, so that none waits for the rest."""
        out = []
        try:
            for is_send, buf, peer in ops:
                if not is_send:
                    seq = self._received.get(peer, 0)
                    self._received[peer] = seq + 1
                    out.append(_RingReceive(self, buf, peer, seq))
                    self.pending.setdefault(peer, []).append(out[-1])
                    continue
                data = _as_bytes(buf.contiguous())
                n = data.numel()
                s = self._send.setdefault(peer, _SendRing())
                off = self._place(peer, s, n) if n else 0
                if n:
                    s.ring.data[off:off + n].copy_(data)
                    s.head = off + n
                    s.unread.append((s.sent, off, n))
                descs = self._where.setdefault(peer, [[], 0])
                descs[0].append(f"{s.sent} {s.gen} {s.ring.size if s.ring else 0} {off} {n}")
                descs[1] += n
                s.sent += 1
                out.append(_Done())
                if descs[1] >= FLUSH_BYTES:  # let the receiver copy these out while the next ones are copied in
                    self._post(peer, self._where.pop(peer)[0])
        except BaseException as err:
            self._where.clear()
            for peer in {peer for is_send, _, peer in ops if is_send}:
                self._post(peer, [f"error {type(err).__name__}: {err}".replace(";", ",")])
            self.close()
            raise
        for peer, (descs, _) in self._where.items():
            self._post(peer, descs)
        self._where.clear()
        return out

    def _post(self, peer: int, descs: list[str]) -> None:
        batch = self.posted.get(peer, 0)
        self.posted[peer] = batch + 1
        self.store.set(f"ring/{self.rank}/{peer}/b{batch}", ";".join(descs))

    def close(self) -> None:
        """Remove the rings no receiver has mapped (a failed sync)."""
        for path in [p for s in self._send.values() for p in s.made]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._send.clear()
        self.mapped.clear()


class PairTransport:
    """`rollout.weight_transport=auto`: each pair of ranks on its own transport (shm on one host, gloo
    between hosts); messages keep their per-pair order because a pair uses one transport."""

    def __init__(self, by_peer: dict[int, object], default):
        self.by_peer, self.default = by_peer, default

    def start(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        """Each transport gets its ops in one call (in their order: the shm rings batch their signals);
        the requests come back in the ops' order."""
        groups: dict[int, tuple[object, list[int]]] = {}
        for i, op in enumerate(ops):
            t = self.by_peer.get(op[2]) or self.default
            groups.setdefault(id(t), (t, []))[1].append(i)
        out = [None] * len(ops)
        for t, idx in groups.values():
            for i, req in zip(idx, t.start([ops[i] for i in idx])):
                out[i] = req
        return out

    def close(self) -> None:
        for t in {id(t): t for t in list(self.by_peer.values()) + [self.default] if hasattr(t, "close")}.values():
            t.close()


def _local_address(store_addr: str, store_port: int) -> str:
    """The address this process reaches the channel's store from (a host's identity toward the others)."""
    family = socket.getaddrinfo(store_addr, store_port)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((store_addr, store_port))
        return sock.getsockname()[0]


def shared_memory_pairs(store, rank: int, world_size: int, *, address: str, prefix: str,
                        room: int) -> list[list[bool]]:
    """Which pairs of channel ranks can use shm rings (collective; every rank gets the same matrix): two
    ranks that reach the store from one address, each see the other's probe file `prefix`-probe-RANK
    (one /dev/shm), and each have `room` bytes of it free."""
    token = os.urandom(8).hex()
    probe = f"{prefix}-probe-{rank}"
    try:  # no /dev/shm, or a full one: this rank's pairs go over gloo
        fs = os.statvfs(os.path.dirname(prefix))
        roomy = fs.f_bavail * fs.f_frsize >= room
        with open(probe, "w") as fh:
            fh.write(token)
    except OSError:
        roomy = False
    store.set(f"probe/{rank}", f"{address} {token} {int(roomy)}")
    info = [store.get(f"probe/{r}").decode().split() for r in range(world_size)]

    def sees(r: int) -> bool:
        try:
            with open(f"{prefix}-probe-{r}") as fh:
                return fh.read() == info[r][1]
        except FileNotFoundError:
            return False

    store.set(f"sees/{rank}", "".join("1" if sees(r) else "0" for r in range(world_size)))
    seen = [store.get(f"sees/{r}").decode() for r in range(world_size)]
    if os.path.exists(probe):
        os.unlink(probe)
    return [[a != b and info[a][0] == info[b][0] and info[a][2] == info[b][2] == "1"
             and seen[a][b] == seen[b][a] == "1" for b in range(world_size)] for a in range(world_size)]


def build_transport(kind: str, *, store, rank: int, world_size: int, timeout: timedelta, name: str,
                    directory: str | None = None, address: tuple[str, int] | None = None,
                    ring_room: int = 1 << 30):
    """The transport of `kind` for this rank (collective over the channel's ranks: every rank calls it
    with the same kind). `name` keeps the files of two channels apart; `address` is the channel store's
    (host, port), from which auto tells hosts apart; `ring_room` the free shared memory auto wants before
    it puts a host's pairs on shm rings; a ring grows to half of it at most (its sender then waits)."""
    if kind not in WEIGHT_TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={kind!r} is unknown; use one of {WEIGHT_TRANSPORTS}")
    if kind in ("gloo", "nccl"):
        return ProcessGroupTransport(store, rank, world_size, timeout, backend=kind)
    if rank == 0:
        store.set("transport_token", os.urandom(6).hex())
    name = f"{name}-{store.get('transport_token').decode()}"  # this channel's files only, on shared storage too
    if kind == "file":
        if not directory:
            raise ValueError("rollout.weight_transport=file needs rollout.weight_transport_dir: a directory every "
                             "rank of both groups can read and write (shared storage)")
        return FileTransport(store, rank, world_size, timeout, directory=os.path.join(directory, name))
    prefix = os.path.join(SHM_ROOT, name)
    max_ring = max(MIN_RING, ring_room // 2)
    if kind == "shm":
        return ShmTransport(store, rank, world_size, timeout, prefix=prefix, max_ring=max_ring)
    host, port = address or ("127.0.0.1", 0)
    pairs = shared_memory_pairs(store, rank, world_size, address=_local_address(host, port or 1),
                                prefix=prefix, room=ring_room)
    everywhere = all(pairs[a][b] for a in range(world_size) for b in range(world_size) if a != b)
    gloo = None if everywhere else ProcessGroupTransport(store, rank, world_size, timeout, backend="gloo")
    peers = [r for r in range(world_size) if pairs[rank][r]]
    if not peers:
        return gloo
    shm = ShmTransport(store, rank, world_size, timeout, prefix=prefix, max_ring=max_ring)
    return shm if gloo is None else PairTransport({r: shm for r in peers}, gloo)
