"""Transports the resharding executor posts its messages on, between two worker groups.

A transport moves byte buffers between ranks of a channel (the training group's ranks first, then
the generation group's: `P2PChannel` in channel.py) and has one method:

    start(ops: [(is_send, uint8 tensor, peer)]) -> [request with .wait()]

Messages between one pair of ranks are matched in the order they are posted, on every transport.

- gloo: point-to-point over TCP (ProcessGroupGloo), any pair of hosts.
- shm: for two ranks on one host: the sender writes the message into a file in shared memory
  (/dev/shm), the receiver reads it into its buffer and removes it; the channel's TCP store carries
  only the "it is there" signal. One copy in, one copy out, no socket.
- file: the same through a directory on shared storage, one safetensors file per message (a
  standard container with its sender, receiver and sequence number in the header): the bytes go
  through the file system; only the small "it is there" signals use the channel's store.
- nccl: ProcessGroupNCCL between GPUs, the same construction as gloo; written for GPU clusters and
  not runnable in this CPU build (torch.distributed.is_nccl_available() is False): choosing it here
  is refused with that reason.

`rollout.weight_transport=auto` is gloo for now: measured on a 2-core gVisor host
(benchmarks/weight_sync.py), gloo over loopback moves a 189 MB fp32 sync in 0.15 s and the
shared-memory files in 0.25 s (each message creates, fills, reads and removes a file, which costs
more here than the socket's copies), so auto does not pick shm until a transport over persistent
shared segments beats gloo.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from rlframe.config.ranges import WEIGHT_TRANSPORTS

SHM_ROOT = "/dev/shm"


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
        if t.safetensors:
            from safetensors.torch import load_file

            data = load_file(path)["message"]
            if data.numel() != self.buf.numel():
                raise ValueError(f"{path}: a message of {data.numel()} bytes for a {self.buf.numel()}-byte buffer")
            self.buf.copy_(data)
        else:
            size = os.path.getsize(path)
            if size != self.buf.numel():
                raise ValueError(f"{path}: {size} bytes for a {self.buf.numel()}-byte buffer")
            with open(path, "rb") as fh:
                fh.readinto(memoryview(self.buf.numpy()))
        os.unlink(path)
        t.store.delete_key(key)


class FileTransport:
    """Messages as files in `directory` (shared memory, or storage every rank mounts); see the module
    docstring. Files are written under a temporary name and renamed, so a reader never sees half of one."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta, *, directory: str,
                 safetensors: bool = False):
        os.makedirs(directory, exist_ok=True)
        self.store, self.rank, self.timeout = store, rank, timeout
        self.directory, self.safetensors = directory, safetensors
        self._sent: dict[int, int] = {}  # peer -> messages sent to it
        self._received: dict[int, int] = {}

    def key(self, src: int, dst: int, seq: int) -> str:
        return f"msg/{src}/{dst}/{seq}"

    def path(self, src: int, dst: int, seq: int) -> str:
        return os.path.join(self.directory, f"{src}-{dst}-{seq}." + ("safetensors" if self.safetensors else "bin"))

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
                if self.safetensors:
                    from safetensors.torch import save_file

                    save_file({"message": _as_bytes(buf.contiguous())}, tmp,
                              metadata={"src": str(self.rank), "dst": str(peer), "seq": str(seq)})
                else:
                    with open(tmp, "wb") as fh:
                        fh.write(memoryview(_as_bytes(buf.contiguous()).numpy()))
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


def build_transport(kind: str, *, store, rank: int, world_size: int, timeout: timedelta, name: str,
                    directory: str | None = None):
    """The transport of `kind` for this rank (collective over the channel's ranks: every rank calls it
    with the same kind). `name` keeps the message files of two channels apart."""
    if kind not in WEIGHT_TRANSPORTS:
        raise ValueError(f"rollout.weight_transport={kind!r} is unknown; use one of {WEIGHT_TRANSPORTS}")
    if kind in ("auto", "gloo", "nccl"):  # auto: gloo (see the module docstring)
        return ProcessGroupTransport(store, rank, world_size, timeout, backend="gloo" if kind == "auto" else kind)
    if rank == 0:
        store.set("transport_token", os.urandom(6).hex())
    name = f"{name}-{store.get('transport_token').decode()}"  # this channel's files only, on shared storage too
    if kind == "file":
        if not directory:
            raise ValueError("rollout.weight_transport=file needs rollout.weight_transport_dir: a directory every "
                             "rank of both groups can read and write (shared storage)")
        return FileTransport(store, rank, world_size, timeout, directory=os.path.join(directory, name),
                             safetensors=True)
    return FileTransport(store, rank, world_size, timeout, directory=os.path.join(SHM_ROOT, name))
