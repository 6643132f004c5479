"""Cost of one no-op call on a worker group of 1, 4 and 8 processes (median of 100 calls).

A call is the whole single-controller path: split the arguments by the dispatch mode, send them to
every rank, wait for all, gather. Both paths are measured in the same run, alternating: plain (one
Ray actor call per rank) and compiled (one execution of the processes' Ray compiled graph,
rlframe/single_controller/compiled.py). Usage: python benchmarks/controller_overhead.py
"""

from __future__ import annotations

import argparse

from report import machine_line, machine_state, markdown_table, median_seconds, write_section

from rlframe.single_controller import Dispatch, RayWorkerGroup, ResourcePool, Worker, register
from rlframe.single_controller.ray_utils import init_local_ray
from rlframe.protocol import DataProto


class Noop(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def noop(self):
        return None

    @register(dispatch=Dispatch.DP_COMPUTE)
    def echo(self, data):
        return data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    import os

    import torch

    before = machine_state()
    init_local_ray()
    batch = DataProto.from_dict(tensors={"input_ids": torch.zeros(64, 128, dtype=torch.long)})
    rows = []
    for n in (1, 4, 8):
        for path in ("plain", "compiled"):
            os.environ["RLFRAME_COMPILED_CALLS"] = "all" if path == "compiled" else "0"  # read when a group starts
            pool = ResourcePool(procs_per_node=[n], name=f"bench{n}{path}")
            group = RayWorkerGroup(pool, Noop, name=f"noop{n}{path}", timeout=300)
            noop = median_seconds(group.noop, args.calls, warmup=5)
            echo = median_seconds(lambda: group.echo(batch), args.calls, warmup=5)
            rows.append([n, path, f"{noop * 1e3:.2f}", f"{echo * 1e3:.2f}"])
            group.shutdown()
            pool.release()
    after = machine_state()
    load = (f"1-minute load average {before['load1']:.1f} before, {after['load1']:.1f} after; fp32 matmul "
            f"{before['gflops']:.0f} / {after['gflops']:.0f} GFLOP/s (2 threads).")
    md = markdown_table(["workers", "call path", "no-op call, median ms", "DP_COMPUTE echo of 64x128 ids, median ms"], rows)
    print(md)
    if not args.no_write:
        write_section("## Controller call overhead", f"Reproduce: `python benchmarks/controller_overhead.py`\n"
                      f"{machine_line()} {load} Median of {args.calls} calls after 5 warm-up calls.\n\n{md}")


if __name__ == "__main__":
    main()
