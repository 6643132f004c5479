"""Size, SFT wall time and accuracy before RL of the pre-trained demo model.

Builds `build_pretrained_model(preset, task="arithmetic", seed, steps)` into a fresh cache
directory (so the SFT is timed, not read from the cache), then measures on the held-out test split:
greedy accuracy, pass@4 and per-sample accuracy at temperature 1, and the rate of well-formed
responses (answer then EOS). Prints a markdown table and replaces the "## Tiny model" section of
docs/benchmarks.md. Reproduce: `python benchmarks/tiny_model.py [--steps 300 600 ...]`
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402

from rlframe.data.pretrain import SFTConfig, build_pretrained_model, sft_examples  # noqa: E402
from rlframe.data.tiny_eval import evaluate_model_dir  # noqa: E402
from rlframe.data.tiny_model import count_parameters  # noqa: E402


def measure(preset: str, steps: int, seed: int, cache: str, threads: int) -> list:
    import torch

    t0 = time.perf_counter()
    cfg = SFTConfig(steps=steps, threads=threads)
    path = build_pretrained_model(preset=preset, seed=seed, cfg=cfg, cache_dir=cache)
    build_s = time.perf_counter() - t0
    info = json.loads((path / "rlframe_pretrain.json").read_text())
    _, test = sft_examples("arithmetic", seed=seed, cfg=SFTConfig(steps=steps))
    torch.set_num_threads(threads)
    res = evaluate_model_dir(path, test, k=4, max_new_tokens=6, seed=seed)
    return [preset, f"{count_parameters(preset) / 1e6:.2f}M", steps, seed, f"{info['sft_wall_s']:.1f}", f"{info['sft_cpu_s']:.1f}",
            f"{build_s:.1f}", f"{info['final_loss']:.3f}", f"{100 * res.greedy_acc:.1f}",
            f"{100 * res.pass_at_k:.1f}", f"{100 * res.sample_acc:.1f}", f"{100 * res.format_rate:.1f}", res.n]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="demo")
    p.add_argument("--steps", type=int, nargs="+", default=[SFTConfig().steps])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=SFTConfig().threads, help="torch threads for SFT and eval")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for steps in args.steps:
            for seed in args.seeds:
                rows.append(measure(args.preset, steps, seed, cache, args.threads))
                print(rows[-1], flush=True)
    table = report.markdown_table(
        ["preset", "params", "SFT steps", "seed", "SFT wall s", "SFT CPU s", "build s", "final loss", "greedy acc %",
         "pass@4 % (T=1)", "sample acc % (T=1)", "answer+EOS %", "test prompts"], rows)
    body = (
        f"Reproduce: `python benchmarks/{os.path.basename(__file__)} --steps {' '.join(map(str, args.steps))} "
        f"--seeds {' '.join(map(str, args.seeds))} --threads {args.threads}`\n"
        f"{report.machine_line()} SFT and evaluation with {args.threads} torch thread(s) "
        "(CPU s = process time of all threads); the machine was shared with other jobs "
        f"(load average {os.getloadavg()[0]:.1f} at the end), so wall times are upper bounds. Task: 2-digit "
        "addition (`23+58=` -> `81`), held-out test split; see docs/tiny_model.md.\n\n" + table
    )
    print(table)
    if not args.no_write:
        report.write_section("## Tiny model", body)


if __name__ == "__main__":
    main()
