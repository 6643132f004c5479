"""GPU throughput (tokens/s, MFU) of `train_step` on the megatron and fsdp engines, to docs/benchmarks.md.

    python benchmarks/gpu_train_step.py [--hidden 2048] [--layers 16] [--batch 16] [--steps 5] [--no-write]

One process on one GPU (NCCL), bf16 compute. A random Qwen2-shaped model (GQA 4:1, SwiGLU
intermediate = 8/3 x hidden rounded up to 128, vocab 32000) is built and saved, then each engine
runs warm-up + timed `train_step`s on the same batch of mixed prompt/response lengths (policy-
gradient loss). Tokens/s counts valid tokens; model FLOPs per token = 6 x parameters + the
attention term 12 x layers x hidden x sequence length (Megatron-LM's formula; padding positions
the engine computes are not counted as useful work); MFU is against the GPU's dense bf16 peak.
Needs CUDA and megatron-core (`pip install -e .[gpu]`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import machine_line, markdown_table, write_section  # noqa: E402
from train_step import _loss, make_batch  # noqa: E402

SECTION = "## GPU training engines (megatron vs fsdp)"
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, SXM


def build_model(path: str, *, hidden: int, layers: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    inter = -(-hidden * 8 // 3 // 128) * 128
    heads = hidden // 128
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _bench(rank, world, path, batch_kw, steps):
    import torch

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    batch = make_batch(**batch_kw)
    rows = []
    for backend in ("megatron", "fsdp"):
        engine = get_train_engine(backend)(TrainEngineConfig(model_path=path, lr=1e-6, micro_batch_size=batch_kw["batch_size"]))
        engine.train_step(_loss, batch)  # warm-up
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = engine.train_step(_loss, batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows.append({"backend": backend, "times": sorted(times), "metrics": m,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        del engine
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return rows, torch.cuda.get_device_name()


def run(hidden: int, layers: int, batch_size: int, steps: int) -> str:
    from rlframe.utils.spawn import run_distributed

    prompt_len, response_len = 256, 512
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(tmp, hidden=hidden, layers=layers)
        batch_kw = dict(batch_size=batch_size, prompt_len=prompt_len, response_len=response_len, vocab=32000)
        rows, gpu = run_distributed(_bench, world_size=1, args=(tmp, batch_kw, steps), backend="nccl",
                                    timeout_s=3600)[0]
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), None)
    seq = prompt_len + response_len
    flops_per_token = 6 * params + 12 * layers * hidden * seq
    cells = []
    for r in rows:
        best, med, m = r["times"][0], r["times"][len(r["times"]) // 2], r["metrics"]
        tps = m["tokens_valid"] / best
        tflops = flops_per_token * tps / 1e12
        cells.append([r["backend"], f"{best:.3f} ({med:.3f})", f"{int(m['tokens_valid'])} / {int(m['tokens_computed'])}",
                      f"{tps:,.0f}", f"{tflops:.1f}", f"{tflops / peak:.1%}" if peak else "n/a", f"{r['peak_gib']:.1f}"])
    head = (f"{machine_line(note=gpu)} Model: Qwen2-shaped, {params / 1e6:.0f}M parameters (hidden {hidden}, "
            f"{layers} layers), bf16 compute with fp32 master weights, 1 GPU; batch {batch_size} sequences of "
            f"{prompt_len // 4}-{prompt_len} prompt + {response_len // 8}-{response_len} response tokens, one "
            f"micro-batch, {steps} timed steps after a warm-up. MFU peak: {peak} TFLOP/s dense bf16.")
    return head + "\n\n" + markdown_table(
        ["engine", "step s, best (median)", "tokens valid / computed", "tokens/s", "TFLOP/s", "MFU", "peak GiB"], cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()
    body = run(args.hidden, args.layers, args.batch, args.steps)
    print(body)
    if not args.no_write:
        command = (f"python benchmarks/gpu_train_step.py --hidden {args.hidden} --layers {args.layers} "
                   f"--batch {args.batch} --steps {args.steps}")
        write_section(SECTION, f"Reproduce: `{command}`\n\n{body}")


if __name__ == "__main__":
    main()
