"""What a user with 1, then 2, then 8 GPUs runs first: does the main job run, how fast, in how much memory.

    python benchmarks/gpu_smoke.py [--gpus 1,2,8] [--models tiny,0.5b] [--steps 4] [--no-pytest] [--no-write]
    python benchmarks/gpu_smoke.py --list      # the cases, without running them (works on CPU)

For each GPU count (those of --gpus that this machine has) and each model, the main job (GRPO with
a reference policy, configs/grpo_tiny.yaml, on the arithmetic task) runs `--steps` steps on GPU
(`resources.use_gpu=true`) in each layout: fsdp dp=g; fsdp with tensor parallel 2 (and vLLM tp 2)
from 2 GPUs; megatron (tp up to 2, pp 2 from 4 GPUs); and split placement, which validation refuses
on GPU until the weight channel stages through host memory (the row passes when it is refused with
that message). Models: `tiny` is the pre-trained demo model (0.8M parameters); `0.5b` is a random
model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151936, tied
embeddings) with the demo tokenizer, built here (nothing is downloaded); the megatron engine takes
untied models only, so its 0.5B rows pass when validation refuses them with that message.

Per case: passed or the last error line, the step time (median of steps 2..N, `perf/time_per_step`),
MFU of the step and the peak memory per GPU. MFU counts 6 x parameters FLOPs per token of the step's
batch (`perf/total_num_tokens`: the actor's update) over the whole step time and the GPUs' dense bf16
peak: generation, the reference and old-log-prob forwards are not counted, so it is a lower bound of
the hardware's use. Peak memory is the largest `memory.used` nvidia-smi reported for any GPU during
the run, sampled every 0.5 s (vLLM's pool and the trainer's together). Then the `gpu`-marked tests
run (`pytest -m gpu tests`) and their count of passed/failed/skipped is the last row.
Printed, and written to docs/gpu.md ("## First GPU run") unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rlframe.jobs import read_metrics  # noqa: E402
from report import machine_line, markdown_table, write_section  # noqa: E402

GPU_MD = ROOT / "docs" / "gpu.md"
SECTION = "## First GPU run"
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense
SPLIT_REFUSAL = "resources.placement=split with resources.use_gpu=true"
# Qwen2.5-0.5B's shape; weights random (seeded), tokenizer the demo's
QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)
JOB = ["data.train_batch_size=16", "data.response_length=32", "actor.mini_batch_size=32",
       "actor.micro_batch_size=4", "trainer.val_every=0", "trainer.save_every=0", "trainer.save_every_minutes=0",
       "trainer.export_hf=false", "trainer.loggers=[jsonl]", "trainer.plot=false", "trainer.progress_bar=false",
       "trainer.max_restarts=0", "resources.use_gpu=true", "rollout.gpu_memory_utilization=0.3"]


def layouts(gpus: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) of the layouts run on `gpus` GPUs."""
    out = [("fsdp", [f"actor.dp={gpus}"])]
    if gpus >= 2:
        out.append(("fsdp-tp2", [f"actor.dp={gpus // 2}", "actor.tp=2", "rollout.tp=2"]))
        out.append(("fsdp-sp2", [f"actor.dp={gpus // 2}", "actor.sp=2"]))  # Ulysses: flash varlen + NCCL all-to-all
    tp = min(gpus, 2)
    pp = 2 if gpus >= 4 else 1
    out.append((f"megatron-tp{tp}-pp{pp}", ["actor.strategy=megatron", f"actor.tp={tp}", f"actor.pp={pp}",
                                            f"actor.dp={gpus // (tp * pp)}", f"rollout.tp={tp}"]))
    if gpus >= 2:
        out.append(("split (refused)", ["resources.placement=split", f"actor.dp={gpus // 2}",
                                        f"+resources.split_procs={{actor: {gpus // 2}, rollout: {gpus // 2}}}"]))
    return out


TIED_REFUSAL = "tie_word_embeddings=True is not supported by the megatron engine"


def expected_refusal(model: str, layout: str) -> str | None:
    """What validation must answer instead of running: split placement on GPU, and megatron with the
    0.5B model (Qwen2.5-0.5B ties its embeddings; the megatron engine takes untied models only)."""
    if layout.startswith("split"):
        return SPLIT_REFUSAL
    if layout.startswith("megatron") and QWEN05B["tie_word_embeddings"] and model == "0.5b":
        return TIED_REFUSAL
    return None


def cases(gpu_counts: list[int], models: list[str]) -> list[dict]:
    return [{"gpus": g, "model": m, "layout": name, "overrides": [f"resources.procs_per_node={g}", *over],
             "refusal": expected_refusal(m, name)}
            for g in gpu_counts for m in models for name, over in layouts(g)]


def build_05b(path: Path) -> int:
    """Write the random 0.5B model with the demo tokenizer to `path`; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlframe.data.tiny_model import PRESETS, save_tokenizer

    tok = save_tokenizer(path, PRESETS["demo"])
    cfg = Qwen2Config(**QWEN05B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


class MemoryPeak:
    """Largest nvidia-smi `memory.used` (MiB) of any GPU while the `with` block runs."""

    def __init__(self):
        self.peak_mib, self._stop = 0, threading.Event()

    def _poll(self):
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                self.peak_mib = max([self.peak_mib, *(int(x) for x in out.split() if x.isdigit())])
            except (OSError, subprocess.SubprocessError):
                pass

    def __enter__(self):
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_case(case: dict, *, model_path: str | None, root: Path, steps: int) -> dict:
    name = f"{case['model']}-{case['gpus']}gpu-{re.sub(r'[^a-z0-9]+', '-', case['layout'])}".strip("-")
    model = [f"model.path={model_path}"] if model_path else ["model.tiny_preset=demo"]
    argv = [sys.executable, "-m", "rlframe.main", "--config-name", "grpo_tiny", *JOB, *model, *case["overrides"],
            f"trainer.total_steps={steps}", f"trainer.output_dir={root}", f"trainer.experiment={name}"]
    t0 = time.perf_counter()
    with MemoryPeak() as mem:
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    refusal = case["refusal"]
    if proc.returncode != 0:
        if refusal and proc.returncode == 2 and refusal in proc.stderr + proc.stdout:
            return {"passed": "yes (refused as expected)", "wall": wall, "peak_gib": mem.peak_mib / 1024}
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["(no output)"]
        return {"passed": f"no: {lines[-1][:160]}", "wall": wall, "peak_gib": mem.peak_mib / 1024}
    if refusal:
        return {"passed": f"no: ran though validation should refuse it ({refusal}): update this case",
                "wall": wall, "peak_gib": mem.peak_mib / 1024}
    rows = read_metrics(root / name)
    times = [r["perf/time_per_step"] for r in rows if r.get("step", 0) >= 2 and "perf/time_per_step" in r]
    tokens = statistics.median(r["perf/total_num_tokens"] for r in rows if "perf/total_num_tokens" in r)
    return {"passed": "yes", "wall": wall, "peak_gib": mem.peak_mib / 1024,
            "step_s": statistics.median(times) if times else None, "tokens": tokens}


def gpu_tests() -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
                          capture_output=True, text=True, cwd=ROOT)
    tail = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    return tail[-1] if tail else f"pytest exited {proc.returncode} with no output"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,2,8", help="GPU counts to run, those above what this machine has skipped")
    ap.add_argument("--models", default="tiny,0.5b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--no-pytest", action="store_true", help="skip the gpu-marked tests")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args()
    models = args.models.split(",")
    wanted = [int(g) for g in args.gpus.split(",")]
    if args.list:
        for c in cases(wanted, models):
            must = f"  [must be refused: {c['refusal']}]" if c["refusal"] else ""
            print(f"{c['gpus']} GPU  {c['model']:5s} {c['layout']:22s} {' '.join(c['overrides'])}{must}")
        return
    import torch

    have = torch.cuda.device_count()
    if have == 0:
        sys.exit("no CUDA GPU visible: gpu_smoke runs the main job on GPUs (--list shows the cases)")
    gpu_name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu_name), None)
    counts = [g for g in wanted if g <= have]
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(os.environ.get("GPU_SMOKE_DIR", tmp))
        root.mkdir(parents=True, exist_ok=True)
        paths, params = {"tiny": None}, {}
        if "0.5b" in models:
            paths["0.5b"] = str(root / "qwen0.5b-shape")
            params["0.5b"] = build_05b(Path(paths["0.5b"]))
        if "tiny" in models:
            from rlframe.data.tiny_model import count_parameters

            params["tiny"] = count_parameters("demo")
        for case in cases(counts, models):
            r = run_case(case, model_path=paths[case["model"]], root=root, steps=args.steps)
            mfu = "n/a"
            if r.get("step_s") and peak:
                mfu = f"{6 * params[case['model']] * r['tokens'] / r['step_s'] / (case['gpus'] * peak * 1e12):.2%}"
            cells.append([case["gpus"], case["model"], case["layout"], r["passed"],
                          f"{r['step_s']:.2f}" if r.get("step_s") else "-", mfu, f"{r['peak_gib']:.1f}",
                          f"{r['wall']:.0f}"])
            print(" | ".join(map(str, cells[-1])), flush=True)
    if not args.no_pytest:
        cells.append(["-", "-", "pytest -m gpu tests", gpu_tests(), "-", "-", "-", "-"])
    head = (f"{machine_line(note=f'{have} x {gpu_name}')} GRPO (grpo_tiny) with the overrides in "
            f"benchmarks/gpu_smoke.py, {args.steps} steps per case; MFU: 6 x parameters x batch tokens over "
            f"the step time and {peak} TFLOP/s dense bf16 per GPU (a lower bound: generation and forwards not counted).")
    body = head + "\n\n" + markdown_table(
        ["GPUs", "model", "layout", "passed", "step s (median 2..N)", "MFU", "peak GiB per GPU", "wall s"], cells)
    print(body)
    if not args.no_write:
        command = f"python benchmarks/gpu_smoke.py --gpus {args.gpus} --models {args.models} --steps {args.steps}"
        write_section(SECTION, f"Reproduce: `{command}`\n\n{body}", path=GPU_MD)


if __name__ == "__main__":
    main()
