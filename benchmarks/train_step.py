"""Throughput of the fsdp engine's `train_step` on this machine, written to docs/benchmarks.md.

    python benchmarks/train_step.py [--preset 12m] [--batch 16] [--steps 5] [--no-write]

Two gloo ranks (one intra-op thread each, so two threads in all: the CPU matmul ceiling of
ENVIRONMENT.md was measured with two threads) run dp2-tp1 and dp1-tp2 layouts of the same model,
with and without padding-free packing, on a batch of mixed prompt/response lengths. Tokens/s
counts valid (non-padding) tokens; model FLOPs use the usual 6 x parameters per token
(forward 2, backward 4; attention FLOPs ignored), and the fraction is of the fp32 matmul rate with
2 threads measured in the same run (before and after, the higher one), printed with the 1-minute
load average before and after.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Training engine"


def make_batch(*, batch_size: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """Mixed lengths: prompts 1/4..1 of prompt_len, responses 1/8..1 of response_len."""
    import torch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(prompt_len // 4, prompt_len + 1, (batch_size,), generator=g)
    rlen = torch.randint(response_len // 8, response_len + 1, (batch_size,), generator=g)
    ids = torch.randint(4, vocab, (batch_size, prompt_len + response_len), generator=g)
    pmask = torch.arange(prompt_len)[None] >= (prompt_len - plen)[:, None]
    rmask = torch.arange(response_len)[None] < rlen[:, None]
    mask = torch.cat([pmask, rmask], 1).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, prompt_len:], "response_mask": rmask.float(),
            "advantages": torch.randn(batch_size, response_len, generator=g)}


def _loss(outputs, mb):
    m = mb["response_mask"]
    return -(outputs["log_probs"] * mb["advantages"] * m).sum() / m.sum(), {}


def _bench(rank, world, path, batch_kw, steps, precisions):
    """Round-robin over the four configurations, one step each per round, so that load changes on
    the shared CPU hit all of them alike; every configuration gets one warm-up step first."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    batch = make_batch(**batch_kw)
    runs = []
    for precision in precisions:
        for dp, tp in ((2, 1), (1, 2)):
            for packed in (True, False):
                mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
                cfg = TrainEngineConfig(model_path=path, dp=dp, tp=tp, lr=1e-5, remove_padding=packed,
                                        mixed_precision=precision == "bf16")
                engine = get_train_engine("fsdp")(cfg, device_mesh=mesh)
                d, n = mesh.get_local_rank("dp"), batch["input_ids"].shape[0] // dp
                mine = {k: v[d * n : (d + 1) * n] for k, v in batch.items()}
                engine.train_step(_loss, mine)  # warm-up
                runs.append({"dp": dp, "tp": tp, "packed": packed, "precision": precision, "engine": engine,
                             "batch": mine, "times": []})
    for _ in range(steps):
        for r in runs:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            r["metrics"] = r["engine"].train_step(_loss, r["batch"])
            torch.distributed.barrier()
            r["times"].append(time.perf_counter() - t0)
    rows = []
    for r in runs:
        times, m = sorted(r["times"]), r["metrics"]
        rows.append({"dp": r["dp"], "tp": r["tp"], "packed": r["packed"], "precision": r["precision"], "step_s": times[0],
                     "median_s": times[len(times) // 2], "tokens_valid": m["tokens_valid"],
                     "tokens_computed": m["tokens_computed"], "tokens_padded": m["tokens_padded"]})
    return rows


def run(preset: str, batch_size: int, steps: int, precisions: tuple[str, ...] = ("fp32",)) -> tuple[str, list[dict]]:
    from rlframe.data.tiny_model import PRESETS, build_random_model, count_parameters
    from rlframe.utils.spawn import run_distributed

    params = count_parameters(preset)
    prompt_len, response_len = 64, 128
    bf16 = "bf16" in precisions
    before = machine_state(bf16=bf16)
    print(f"load {before['load1']:.1f}, matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_random_model(Path(tmp) / preset, preset=preset, seed=0))
        batch_kw = dict(batch_size=batch_size, prompt_len=prompt_len, response_len=response_len, vocab=100)
        rows = run_distributed(_bench, world_size=2, args=(path, batch_kw, steps, precisions), timeout_s=1800,
                               env={"RLFRAME_THREADS_PER_RANK": "1"})[0]
    after = machine_state(bf16=bf16)
    ceilings = {"fp32": max(before["gflops"], after["gflops"])}
    if bf16:
        ceilings["bf16"] = max(before["gflops_bf16"], after["gflops_bf16"])
    shape = PRESETS[preset]
    lines = [
        f"`train_step` of the `{preset}` preset ({params / 1e6:.2f}M parameters, hidden {shape.hidden_size}, "
        f"{shape.num_layers} layers), {' and '.join(precisions)}, 2 gloo ranks x 1 thread; batch {batch_size} sequences, "
        f"prompts {prompt_len // 4}-{prompt_len} + responses {response_len // 8}-{response_len} tokens "
        f"(mixed lengths), one micro-batch per rank, {steps} timed steps per configuration after one "
        "warm-up, taken round-robin across configurations. "
        "The CPU is shared with other jobs, so tokens/s uses the fastest step (median shown too). "
        f"Tokens = valid tokens; model FLOPs = 6 x params x tokens; ceiling = {ceilings['fp32']:.0f} GFLOP/s, the fp32 "
        f"matmul rate with 2 threads measured in this run ({before['gflops']:.0f} before, {after['gflops']:.0f} "
        f"after)" + (f"; bf16 rows (bf16 compute, fp32 master weights) against the bf16 rate, {ceilings['bf16']:.0f} "
                     f"GFLOP/s ({before['gflops_bf16']:.0f} before, {after['gflops_bf16']:.0f} after)" if bf16 else "")
        + f"; 1-minute load average {before['load1']:.1f} before, {after['load1']:.1f} after.",
    ]
    cells = []
    for r in rows:
        tps = r["tokens_valid"] / r["step_s"]
        gflops = 6 * params * tps / 1e9
        ceiling = ceilings[r["precision"]]
        cells.append([f"dp{r['dp']}-tp{r['tp']}", r["precision"], "yes" if r["packed"] else "no",
                      f"{int(r['tokens_valid'])} / {int(r['tokens_computed'])} / {int(r['tokens_padded'])}",
                      f"{r['step_s']:.2f} ({r['median_s']:.2f})", f"{tps:,.0f}", f"{gflops:.1f}",
                      f"{gflops / ceiling:.1%}",
                      f"{6 * params * r['tokens_computed'] / r['step_s'] / 1e9 / ceiling:.1%}"])
    lines += ["", markdown_table(["layout", "precision", "padding-free", "tokens valid / computed / padded",
                                  "step s, best (median)", "tokens/s", "GFLOP/s", "of ceiling",
                                  "of ceiling, computed tokens"], cells)]
    by = {(r["dp"], r["tp"], r["packed"], r["precision"]): r for r in rows}
    lines.append("")
    for dp, tp in ((2, 1), (1, 2)):
        p, u = by[(dp, tp, True, "fp32")], by[(dp, tp, False, "fp32")]
        lines.append(
            f"- dp{dp}-tp{tp} (fp32): padding-free packing computes {1 - p['tokens_computed'] / u['tokens_computed']:.0%} "
            f"fewer token positions than the padded batch and its best step is {u['step_s'] / p['step_s']:.2f}x "
            "as fast (median " f"{u['median_s'] / p['median_s']:.2f}x)."
        )
    lines.append("- Valid vs computed tokens: packing fills rows up to the longest sequence, so mixed lengths leave "
                 "gaps (computed > valid); the last column counts every computed token (the matrix multiplies "
                 "themselves run near the one-thread peak, torch.profiler; elementwise work and attention make the "
                 "rest).")
    return "\n".join(lines), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="12m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precisions", default="fp32", help="comma-separated, of fp32,bf16")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()
    precisions = tuple(args.precisions.split(","))
    if "fp32" not in precisions or not set(precisions) <= {"fp32", "bf16"}:
        raise SystemExit(f"--precisions {args.precisions}: fp32 and optionally bf16")
    body, _ = run(args.preset, args.batch, args.steps, precisions)
    print(body)
    if not args.no_write:
        command = (f"python benchmarks/train_step.py --preset {args.preset} --batch {args.batch} --steps {args.steps} "
                   f"--precisions {args.precisions}")
        write_section(SECTION, f"Reproduce: `{command}` (measured {time.strftime('%Y-%m-%d')}; the load "
                      f"averages and the matmul ceiling of the run are in the text below).\n\n{body}")


if __name__ == "__main__":
    main()
