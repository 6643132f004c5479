"""How fast a DataProto moves: pickling, Ray's object store, and a driver -> actor -> driver trip.

Payload (default): `input_ids` (1024, 2048) int64 plus four (1024, 2048) float32 tensors
(`old_log_probs`, `ref_log_prob`, `values`, `advantages`): 48 MiB. Each row reports payload bytes
divided by the median wall time of `--repeats` runs, for:

  (a) pickle.dumps + pickle.loads, protocol 5, in one process: with a buffer_callback (payloads
      that support it stay out of the stream, so this measures the per-object overhead only) and
      without one (in-band: every byte is copied into the stream and out again);
  (b) ray.put + ray.get in the driver;
  (c) a Ray actor call that returns its argument (driver -> actor -> driver: the payload crosses
      the object store twice; the row still divides one payload by the round-trip time);
  (d) the same with a plain dict of torch tensors (Ray's default tensor pickling), and with a dict
      of numpy arrays, which Ray hands back as read-only views of shared memory (the zero-copy
      ceiling; DataProto copies such buffers once on arrival, see rlframe/protocol/serialize.py).

Ray runs in a child process so the `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1` variant (Ray's opt-in
tensor reducer, which aliases shared memory and is only safe for tensors never written) can be
measured with the same code under a fresh Ray.

Usage: python benchmarks/dataproto_transfer.py [--rows 1024 --cols 2048 --repeats 5] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import torch

from report import machine_line, markdown_table, median_seconds, write_section

from rlframe.protocol import DataProto, receive_zero_copy

SECTION = "## DataProto transfer"
NOTES = """Reading the table:
- (a) out-of-band: DataProto and numpy hand their bytes to the buffer_callback, so the pickle
  stream is a few hundred bytes and the time is the per-object overhead (about 0.1 ms), not a
  bandwidth; torch tensors ignore the callback and stay in-band.
- (b)/(c) DataProto vs a dict of torch tensors: Ray's default tensor pickling copies every byte
  into the stream and out; DataProto lets Ray place the bytes in the object store directly and
  then makes one private copy per tensor on arrival (Ray's buffers are read-only memory shared by
  all readers on the node, and torch has no read-only tensors). `receive_zero_copy()` skips that
  copy where the caller only reads or immediately concatenates, which reaches the numpy ceiling
  in (b). In (c) the actor side still copies on arrival, as workers may write in place.
- On this 2-core machine a fresh 48 MiB allocation is page-fault bound (about 1 GB/s), so each
  private copy costs about 50 ms; the machine was shared with other jobs (load average above 10),
  so single rows vary by up to 2x between runs.
"""
FLOAT_KEYS = ("old_log_probs", "ref_log_prob", "values", "advantages")


def make_tensors(rows: int, cols: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {"input_ids": torch.randint(0, 50_000, (rows, cols), generator=g)}
    for key in FLOAT_KEYS:
        tensors[key] = torch.randn(rows, cols, generator=g)
    return tensors


def payloads(rows: int, cols: int) -> dict[str, object]:
    tensors = make_tensors(rows, cols)
    return {
        "DataProto": DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0}),
        "dict of torch tensors": dict(tensors),
        "dict of numpy arrays": {k: v.numpy() for k, v in tensors.items()},
    }


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# Every time below is report.median_seconds: one untimed warm-up run (first-touch page faults,
# Ray worker start, class registration), then the median of `repeats` runs.
def measure_pickle(rows: int, cols: int, repeats: int) -> list[tuple[str, str, float]]:
    out = []
    for name, obj in payloads(rows, cols).items():
        def out_of_band(obj=obj):
            buffers = []
            data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
            pickle.loads(data, buffers=buffers)

        def in_band(obj=obj):
            pickle.loads(pickle.dumps(obj, protocol=5))

        out.append(("(a) pickle p5, out-of-band buffers", name,
                    median_seconds(out_of_band, repeats)))
        out.append(("(a) pickle p5, in-band", name, median_seconds(in_band, repeats)))
    return out


def measure_ray(rows: int, cols: int, repeats: int, names: list[str]) -> list[tuple[str, str, float]]:
    """Runs inside the child process: ray.put/get and an actor round trip."""
    import ray

    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=1 << 30)

    @ray.remote(num_cpus=1)
    class Echo:
        def echo(self, x):
            return x

    actor = Echo.remote()
    out = []
    for name, obj in payloads(rows, cols).items():
        if name not in names:
            continue
        out.append(("(b) ray.put + ray.get", name, median_seconds(lambda: ray.get(ray.put(obj)), repeats)))
        out.append(
            ("(c) driver -> actor -> driver", name, median_seconds(lambda: ray.get(actor.echo.remote(obj)), repeats))
        )
        if name == "DataProto":  # the driver side aliases instead of copying (the actor still copies)
            def put_get_alias():
                with receive_zero_copy():
                    return ray.get(ray.put(obj))

            def trip_alias():
                with receive_zero_copy():
                    return ray.get(actor.echo.remote(obj))

            label = "DataProto, driver receives in receive_zero_copy()"
            out.append(("(b) ray.put + ray.get", label, median_seconds(put_get_alias, repeats)))
            out.append(("(c) driver -> actor -> driver", label, median_seconds(trip_alias, repeats)))
    ray.shutdown()
    return out


def run_ray_child(args, names: list[str], env_extra: dict[str, str], label: str) -> list[tuple[str, str, float]]:
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, __file__, "--ray-child", json.dumps(names), "--rows", str(args.rows),
           "--cols", str(args.cols), "--repeats", str(args.repeats)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"Ray child failed:\n{res.stderr[-3000:]}")
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    return [(mode, name + label, s) for mode, name, s in rows]


def table(results, payload_bytes: int) -> str:
    rows = [[mode, name, f"{s:.4f}", f"{payload_bytes / s / 1e9:.2f}"] for mode, name, s in results]
    return markdown_table(["mode", "payload type", "median s", "GB/s"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="print the table, leave docs/benchmarks.md alone")
    p.add_argument("--ray-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.ray_child is not None:
        print(json.dumps(measure_ray(args.rows, args.cols, args.repeats, json.loads(args.ray_child))))
        return

    payload_bytes = nbytes(make_tensors(args.rows, args.cols))
    results = measure_pickle(args.rows, args.cols, args.repeats)
    ray_rows = run_ray_child(args, ["DataProto", "dict of torch tensors", "dict of numpy arrays"], {}, "")
    ray_rows += run_ray_child(
        args, ["dict of torch tensors"], {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"},
        " (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1)",
    )
    results += sorted(ray_rows, key=lambda r: r[0])
    md = table(results, payload_bytes)
    print(md)
    if args.no_write:
        return
    cmd = "python benchmarks/dataproto_transfer.py"
    if (args.rows, args.cols, args.repeats) != (1024, 2048, 5):
        cmd += f" --rows {args.rows} --cols {args.cols} --repeats {args.repeats}"
    import ray

    body = (
        f"Payload: `input_ids` ({args.rows}, {args.cols}) int64 + 4 float32 tensors of the same shape = "
        f"{payload_bytes / 2**20:.0f} MiB. GB/s = payload bytes / median seconds of {args.repeats} runs "
        "(after one warm-up); round trips divide one payload by the round-trip time.\n"
        + machine_line(note="shared with other jobs", packages={"ray": ray.__version__, "numpy": np.__version__})
        + f"\n\nReproduce: `{cmd}`\n\n{md}\n\n{NOTES}"
    )
    write_section(SECTION, body)


if __name__ == "__main__":
    main()
