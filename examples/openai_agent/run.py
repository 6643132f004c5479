"""The tool task trained through the OpenAI endpoint (agent.mode=openai, environment.py here) against the
in-process agent loop, with the same settings, data, seed and steps (examples/agent_tools/run.py's).

    python examples/openai_agent/run.py                # 40 steps each, writes results.md here
    python examples/openai_agent/run.py --steps 6 --no-write

Both runs sample each turn with the same seeds (the endpoint seeds a turn from the step's seed, the
sample and the turn, as the loop does) and the environment runs the same calculator, so they differ
only where a turn holds a malformed call: the loop answers it with an error and goes on, the OpenAI API
has no such call, so the environment's episode ends there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from examples.agent_tools.run import run, summary  # noqa: E402

RUNS = {"in-process agent loop": ["agent.enabled=true"],
        "OpenAI environment": ["agent.enabled=true", "agent.mode=openai",
                               f"agent.environment={HERE / 'environment.py'}:episode"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, steps=args.steps, out=Path(tmp), overrides=extra) for name, extra in RUNS.items()}
    lines = ["| run | held-out accuracy, step 0 -> end | turns per trajectory (median) | generation s/step | step s |",
             "|---|---|---|---|---|"]
    for name, rows in results.items():
        s = summary(rows)
        lines.append(f"| {name} | {100 * s['start']:.1f}% -> {100 * s['end']:.1f}% | {s['turns']:.2f} | "
                     f"{s['gen_s']:.2f} | {s['step_s']:.2f} |")
    env = [r for r in results["OpenAI environment"] if r["step"] >= 1]
    ok = min(r["agent/env_ok_frac"] for r in env)
    calls = sum(r["agent/generate_calls"] for r in env) / len(env)
    requests = sum(r["agent/requests"] for r in env) / len(env)
    table = "\n".join(lines) + (f"\n\nOpenAI environment: the lowest share of episodes that finished (status ok) at a "
                                f"step: {100 * ok:.0f}%; {requests:.0f} requests in {calls:.1f} generate calls per step "
                                "on average.")
    print(table)
    if not args.no_write:
        cmd = f"python examples/openai_agent/run.py --steps {args.steps}"
        (HERE / "results.md").write_text(f"# The tool task through the OpenAI endpoint (`{cmd}`)\n\n"
                                         f"GRPO, {args.steps} steps of 32 prompts x 4 samples, the pre-trained `agent` "
                                         "preset, 128 held-out prompts (greedy), one seed.\n\n" + table + "\n")


if __name__ == "__main__":
    main()
