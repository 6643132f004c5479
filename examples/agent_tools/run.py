"""Multi-turn RL with a calculator tool, against the same budget without tools.

    python examples/agent_tools/run.py                 # 40 steps each, writes results.md and agent.png here
    python examples/agent_tools/run.py --steps 6 --no-write

The task (data.task=tool_arithmetic): products of a 2-digit and a 3-digit number, answered as
<answer>n</answer>; the tiny `agent` preset (BPE tokenizer, Qwen-style chat template) was
pre-trained on transcripts that call the calculator or answer directly. Both runs are GRPO with the
same data, seed, steps and settings; one runs the agent loop (agent.enabled=true: tool calls are
executed and their results come back as tool turns), the other generates single-turn (a call the
policy writes is just text). Writes results.md (final held-out greedy accuracy, tool-call and
success rates, turns, generation time per step) and agent.png (accuracy and tool use vs step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

COMMON = ["--config-name", "grpo_tiny", "model.tiny_preset=agent", "data.task=tool_arithmetic", "data.prompt_length=128",
          "data.response_length=96", "data.train_batch_size=32", "data.val_size=128", "actor.mini_batch_size=128",
          "rollout.kv_cache_bytes=134217728", "trainer.save_every=0", "trainer.export_hf=false", "trainer.plot=false",
          "trainer.resume=off", "trainer.progress_bar=false", "trainer.loggers=[jsonl]"]
RUNS = {"with tools": ["agent.enabled=true"], "without tools": ["agent.enabled=false"]}


def run(name: str, *, steps: int, out: Path, overrides: list[str] | None = None) -> list[dict]:
    """One run's metrics rows: COMMON plus RUNS[name] (or `overrides`)."""
    exp = name.replace(" ", "_")
    extra = RUNS[name] if overrides is None else overrides
    cmd = [sys.executable, "-m", "rlframe.main", *COMMON, *extra, f"trainer.total_steps={steps}",
           f"trainer.val_every={max(1, steps // 4)}", f"trainer.output_dir={out}", f"trainer.experiment={exp}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / exp / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    steps = [r for r in rows if r["step"] >= 1]
    vals = [r for r in rows if "val/accuracy" in r]

    def med(key):
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else float("nan")

    return {"start": vals[0]["val/accuracy"], "end": vals[-1]["val/accuracy"],
            "val_call_rate": vals[-1].get("val/agent/tool_call_rate", float("nan")),
            "val_success": vals[-1].get("val/agent/tool_success_rate", float("nan")),
            "call_rate": med("agent/tool_call_rate"), "success": med("agent/tool_success_rate"),
            "turns": med("agent/turns_mean"), "gen_s": med("timing_s/gen"), "step_s": med("timing_s/step")}


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        vals = [r for r in rows if "val/accuracy" in r]
        a.plot([r["step"] for r in vals], [100 * r["val/accuracy"] for r in vals], marker="o", label=name)
    with_tools = [r for r in results["with tools"] if r["step"] >= 1]
    for key, label in (("agent/tool_call_rate", "tool-call rate"), ("agent/tool_success_rate", "tool success rate")):
        b.plot([r["step"] for r in with_tools], [100 * r.get(key, float("nan")) for r in with_tools], label=label)
    a.set(xlabel="step", ylabel="held-out accuracy, greedy (%)", title="accuracy")
    b.set(xlabel="step", ylabel="%", title="tool use during training (with tools)")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, steps=args.steps, out=Path(tmp)) for name in RUNS}
    lines = ["| run | held-out accuracy, step 0 -> end | tool-call rate (train, median) | tool success rate | "
             "turns per trajectory | generation s/step | step s |", "|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        s = summary(rows)
        tools = (f"{100 * s['call_rate']:.0f}% | {100 * s['success']:.0f}% | {s['turns']:.2f}"
                 if s["call_rate"] == s["call_rate"] else "- | - | 1 (single turn)")  # nan: no agent loop
        lines.append(f"| {name} | {100 * s['start']:.1f}% -> {100 * s['end']:.1f}% | {tools} | "
                     f"{s['gen_s']:.2f} | {s['step_s']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        cmd = f"python examples/agent_tools/run.py --steps {args.steps}"
        (HERE / "results.md").write_text(f"# Tools vs no tools (`{cmd}`)\n\n{table}\n")
        plot(results, HERE / "agent.png")


if __name__ == "__main__":
    main()
