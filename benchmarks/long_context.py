"""Long sequences with Ulysses sequence parallelism: activation memory per rank and time per token vs sp.

    python benchmarks/long_context.py [--preset 12m] [--lengths 2048,8192] [--sps 1,2,4] [--steps 3] [--no-write]

One training step (forward and backward of a policy-gradient loss, then AdamW) on one sequence of L
tokens (a quarter prompt, the rest response), with the fsdp engine at sp = 1, 2, 4: sp gloo ranks,
each computing L / sp positions. For each configuration, in its own processes:
- peak memory per rank: the resident set's high-water mark during the step above the resident set
  before it (after a warm-up step, so the weight shards and Adam state are already there, and
  after returning the C heap's free pages to the kernel): the step's activations and transient
  buffers, measured (Linux VmHWM, reset through clear_refs);
- the dry run's activation estimate for the same micro-batch (rlframe.plan.activation_memory);
- seconds per step (median over --steps after the warm-up) and tokens per second.
The machine has 2 cores: sp=1 runs 1 rank x 2 threads, sp=2 2 ranks x 1 thread, sp=4 4 ranks x 1
thread (oversubscribed), so times compare the same machine, not the same core count per rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import machine_state, markdown_table, write_section  # noqa: E402

SECTION = "## Long sequences: Ulysses sequence parallelism"
MiB = 1 << 20


def _batch(length: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    prompt = length // 4
    ids = torch.randint(4, vocab, (1, length), generator=g)
    mask = torch.ones(1, length, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(length)[None],
            "responses": ids[:, prompt:], "response_mask": torch.ones(1, length - prompt),
            "advantages": torch.randn(1, length - prompt, generator=g)}


def _loss(outputs, mb):
    m = mb["response_mask"]
    return -(outputs["log_probs"] * mb["advantages"] * m).sum() / m.sum(), {}


def _return_free_memory() -> None:
    """Give the C heap's free pages back to the kernel (glibc malloc_trim), so that the resident set
    before a step holds only live memory."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _measure(rank, world, path, length, steps):
    import torch

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine
    from rlframe.workers.rollout.weight_sync import MemoryWatch

    engine = get_train_engine("fsdp")(TrainEngineConfig(model_path=path, dp=1, sp=world, lr=1e-5))
    batch = _batch(length, engine.vocab_size)
    engine.train_step(_loss, batch)  # warm-up: optimizer state, allocator pools
    times, peaks = [], []
    for _ in range(steps):
        torch.distributed.barrier()
        _return_free_memory()  # else the step reuses pages the warm-up freed and the peak reads low
        watch = MemoryWatch()
        t0 = time.perf_counter()
        engine.train_step(_loss, batch)
        torch.distributed.barrier()
        times.append(time.perf_counter() - t0)
        peaks.append(watch.peak_extra()[0])
    return {"step_s": statistics.median(times), "times": times, "peak_bytes": max(peaks)}


def _estimate(preset: str, length: int, sp: int) -> float:
    from rlframe.plan.activation_memory import micro_batch_bytes
    from rlframe.data.tiny_model import PRESETS
    from rlframe.data.tokenizer import build_char_tokenizer
    from rlframe.resharding.formats import ModelDims

    s = PRESETS[preset]
    dims = ModelDims.from_hf_config(ModelDims.config_namespace({
        "num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size, "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads, "intermediate_size": s.intermediate_size,
        "vocab_size": len(build_char_tokenizer()), "model_type": "qwen2"}))
    return micro_batch_bytes(dims, modules="transformers", itemsize=4, tp=1, sequence_parallel=False, tokens=length,
                             seq_len=length, layers=dims.num_layers, last_stage=True, head="lm",
                             checkpointing=False, ulysses=sp)


def run(preset: str, lengths: list[int], sps: list[int], steps: int) -> str:
    from rlframe.data.tiny_model import build_random_model, count_parameters
    from rlframe.utils.spawn import run_distributed

    before = machine_state()
    print(f"load {before['load1']:.2f}, fp32 matmul {before['gflops']:.0f} GFLOP/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_random_model(Path(tmp) / preset, preset=preset, seed=0))
        for length in lengths:
            base = None
            for sp in sps:
                threads = str(max(1, 2 // sp))
                res = run_distributed(_measure, world_size=sp, args=(path, length, steps), timeout_s=3600,
                                      env={"RLFRAME_THREADS_PER_RANK": threads})
                peak = max(r["peak_bytes"] for r in res)
                step = res[0]["step_s"]
                base = base or (peak, step)
                row = [length, sp, f"{sp} x {threads}", f"{peak / MiB:,.0f}", f"{base[0] / peak:.2f}x",
                       f"{_estimate(preset, length, sp) / MiB:,.0f}", f"{step:.2f} ({min(res[0]['times']):.2f}-"
                       f"{max(res[0]['times']):.2f})", f"{length / step:,.0f}", f"{step / base[1]:.2f}x"]
                rows.append(row)
                print(" | ".join(str(c) for c in row), flush=True)
    after = machine_state()
    params = count_parameters(preset)
    head = (f"One training step on one sequence of L tokens (a quarter prompt), `{preset}` preset "
            f"({params / 1e6:.1f}M parameters), fp32, fsdp engine with dp=1 and Ulysses sp ranks; {steps} timed "
            f"steps after a warm-up, each configuration in its own processes. Peak = the largest rank's resident "
            "high-water mark during the step above its resident set before it: the activations plus what every "
            "step allocates anew (FSDP's gathered parameters and unsharded gradients, gathered once per step on "
            "CPU, and the backward's transient buffers); the weight shards and Adam state were there before. "
            f"Estimate = the dry run's activation model for the same micro-batch (activations only). fp32 matmul {before['gflops']:.0f} GFLOP/s before, {after['gflops']:.0f} after (2 "
            f"threads); 1-minute load average {before['load1']:.2f} before, {after['load1']:.2f} after.")
    table = markdown_table(["L", "sp", "ranks x threads", "peak MiB per rank", "less than sp=1",
                            "estimate MiB", "s/step, median (range)", "tokens/s", "time vs sp=1"], rows)
    return head + "\n\n" + table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="12m")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--sps", default="1,2,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    sps = [int(x) for x in args.sps.split(",")]
    body = run(args.preset, lengths, sps, args.steps)
    print(body)
    if not args.no_write:
        command = (f"python benchmarks/long_context.py --preset {args.preset} --lengths {args.lengths} "
                   f"--sps {args.sps} --steps {args.steps}")
        write_section(SECTION, f"Reproduce: `{command}` (measured {time.strftime('%Y-%m-%d')}).\n\n{body}")


if __name__ == "__main__":
    main()
