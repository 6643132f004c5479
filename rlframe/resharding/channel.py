"""A point-to-point channel between worker groups that each have their own torch.distributed world
(split placement: the actor's training group and the generation group).

Every process of both groups joins the channel, outside its default world: ranks 0..A-1 are the
training group's, A..A+R-1 the generation group's, which is how a cross-group `Plan` numbers them.
The executor posts its sends and receives on the channel's transport (transport.py: gloo over TCP,
shared memory between ranks on one host, files on shared storage, NCCL on GPUs) instead of
`dist.batch_isend_irecv`; a rank of one group never joins the other group's collectives.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from rlframe.resharding.transport import build_transport


class P2PChannel:
    """`rank` in the channel's numbering; `start(ops)` posts [(is_send, uint8 buffer, peer)] on the
    transport `transport` names (collective: every rank of both groups opens the channel with the same
    address, port and transport) and returns the requests to wait on. `ring_room`: the free shared memory
    transport=auto wants on a host before it joins that host's pairs by shm rings (a few buckets' worth)."""

    def __init__(self, *, addr: str, port: int, rank: int, world_size: int, timeout_s: float = 1800.0,
                 transport: str = "gloo", directory: str | None = None, ring_room: int = 1 << 30):
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.kind = rank, world_size, transport
        self._store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout)
        self.transport = build_transport(transport, store=self._store, rank=rank, world_size=world_size,
                                         timeout=timeout, name=f"rlframe-weights-{port}", directory=directory,
                                         address=(addr, port), ring_room=ring_room)

    def start(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        return self.transport.start(ops)

    def close(self) -> None:
        """Remove what the transport left on shared storage (rings no receiver mapped, message files)."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()
