"""A tour of the single controller: one driver, a worker group of 4 processes, real collectives.

    python -m rlframe.single_controller.demo

The driver (this process) starts Ray, reserves 4 slots, and starts 4 worker processes that join
one gloo process group. The workers declare a 2 x 2 mesh (dp=2, tp=2). Then:
1. a tensor-parallel matmul: each tp rank holds half of W's columns; the driver's batch is split
   over dp, both tp peers of a dp rank get the same rows, compute their half, and all-gather it;
   the driver gathers one result per dp group and checks it against a single-process matmul;
2. a Monte-Carlo estimate of pi: every rank samples, one all-reduce sums the hits;
3. the cost of a no-op call on the group (split, 4 remote calls, gather).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from rlframe.single_controller import Dispatch, Mesh, RayWorkerGroup, ResourcePool, Worker, register
from rlframe.protocol import DataProto

HIDDEN, OUT = 16, 8


class DemoWorker(Worker):
    def __init__(self, *, seed: int):
        self.set_mesh(Mesh.of(dp=2, tp=2))
        coords = self.mesh.coords(self.rank)
        self.tp_rank = coords["tp"]
        # Every rank must create every tp group (a collective call), then keeps its own.
        for dp in range(2):
            ranks = [self.mesh.rank_of(dp=dp, tp=t) for t in range(2)]
            group = dist.new_group(ranks)
            if coords["dp"] == dp:
                self.tp_group = group
        full = torch.randn(HIDDEN, OUT, generator=torch.Generator().manual_seed(seed))
        self.w_shard = full.chunk(2, dim=1)[self.tp_rank].clone()  # column-parallel
        self.seed = seed

    @register(dispatch=Dispatch.DP_COMPUTE)
    def matmul(self, data: DataProto) -> DataProto:
        x = data.batch["x"]  # (B/dp, HIDDEN), identical on both tp peers
        partial = x @ self.w_shard  # (B/dp, OUT/tp)
        parts = [torch.empty_like(partial) for _ in range(2)]
        dist.all_gather(parts, partial, group=self.tp_group)
        return DataProto.from_dict(tensors={"y": torch.cat(parts, dim=1)})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def estimate_pi(self, samples: int) -> float:
        g = torch.Generator().manual_seed(1000 + self.rank)
        xy = torch.rand(samples, 2, generator=g)
        hits = torch.tensor([float(((xy**2).sum(1) <= 1).sum())])
        dist.all_reduce(hits)
        return 4.0 * hits.item() / (samples * self.world_size)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None


def main() -> None:
    from rlframe.single_controller.ray_utils import init_local_ray

    print(__doc__)
    t0 = time.perf_counter()
    init_local_ray()
    pool = ResourcePool(procs_per_node=[4], name="demo")
    group = RayWorkerGroup(pool, DemoWorker, name="demo", kwargs={"seed": 0}, timeout=300)
    print(f"[start] Ray + 4 worker processes in one gloo group: {time.perf_counter() - t0:.1f}s")
    print(f"        mesh per rank: {[str(Mesh.of(dp=2, tp=2).coords(r)) for r in range(4)]}")

    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))
    out = group.matmul(DataProto.from_dict(tensors={"x": x}))
    w = torch.randn(HIDDEN, OUT, generator=torch.Generator().manual_seed(0))
    err = (out.batch["y"] - x @ w).abs().max().item()
    print(f"[1] tensor-parallel matmul of an 8 x {HIDDEN} batch: dp ranks got 4 rows each, tp ranks "
          f"{OUT // 2} of {OUT} columns; max |error| vs one process = {err:.2e}")
    assert err < 1e-5, err

    pi = group.estimate_pi(200_000)
    print(f"[2] pi from 4 x 200,000 samples and one all_reduce: {pi[0]:.4f} (every rank agrees: "
          f"{len(set(pi)) == 1})")

    lat = []
    for _ in range(50):
        t = time.perf_counter()
        group.noop()
        lat.append(time.perf_counter() - t)
    print(f"[3] no-op call on 4 workers: median {statistics.median(lat) * 1e3:.2f} ms over 50 calls")
    group.shutdown()
    pool.release()
    print("demo finished: the driver split inputs, the workers computed together, the driver gathered.")


if __name__ == "__main__":
    main()
