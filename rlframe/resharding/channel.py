"""A point-to-point channel between worker groups that each have their own torch.distributed world
(split placement: the actor's training group and the generation group).

Every process of both groups joins one more gloo process group, outside its default world: ranks
0..A-1 are the training group's, A..A+R-1 the generation group's, which is how a cross-group `Plan`
numbers them. The executor posts its sends and receives on it instead of `dist.batch_isend_irecv`;
a rank of one group never joins the other group's collectives. (On GPU the same construction with
`ProcessGroupNCCL` would move the buckets device to device; only gloo is built and tested here.)
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class P2PChannel:
    """`rank` in the channel's numbering; `start(ops)` posts [(is_send, uint8 buffer, peer)] and
    returns the requests to wait on."""

    def __init__(self, *, addr: str, port: int, rank: int, world_size: int, timeout_s: float = 1800.0):
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self._store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout)
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("rlframe-weights", self._store), rank, world_size, timeout)

    def start(self, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
        # Messages between one pair of ranks are matched in the order they are posted (gloo pairs
        # are FIFO per tag), as with batch_isend_irecv.
        return [(self._pg.send if is_send else self._pg.recv)([buf], peer, 0) for is_send, buf, peer in ops]
