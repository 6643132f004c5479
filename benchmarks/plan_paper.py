"""`rlframe plan` on paper for the cluster configs: the 70B PPO (16 nodes x 8 GPUs) and the Qwen 7B
GRPO (2 x 8), the plan it chooses against the hand-written one, with H100 figures assumed.

    python benchmarks/plan_paper.py [--no-write]

No GPU is measured: the constants are rlframe/plan/cost.py's H100_ASSUMED (datasheet peaks times
efficiencies from published reports, each stated there). For each config: the plans that fit the
devices (the dry run's memory estimate), the chosen plan's estimated phases and memory peak, and
the same for the config as written. Takes about a minute (the 70B config has about 2,000 plans).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from report import markdown_table, write_section  # noqa: E402

SECTION = "## Execution plans on paper: the 70B and 7B configs"
CONFIGS = ("ppo_llama70b", "grpo_qwen7b")
PHASES = ("gen", "ref", "old_log_prob", "values", "update_critic", "update_actor", "update_weights")


def describe(cfg) -> str:
    a = cfg.actor
    text = f"actor {a.strategy} dp{a.dp} tp{a.tp} pp{a.pp} mb{a.micro_batch_size}"
    if cfg.uses_critic:
        c = cfg.critic
        text += f", critic {c.strategy} dp{c.dp} tp{c.tp} pp{c.pp} mb{c.micro_batch_size}"
    return text + f", rollout tp{cfg.rollout.tp}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from rlframe.config import load_config, validate
    from rlframe.plan.dry_run import model_dims
    from rlframe.plan.cost import H100_ASSUMED, estimate
    from rlframe.plan.space import enumerate_plans, peak_gib

    parts = [f"Reproduce: `python benchmarks/plan_paper.py`. Constants: {H100_ASSUMED.source}; the figures and "
             "their sources are listed with H100_ASSUMED and in docs/plan.md. Memory: the dry run's estimate "
             "(GiB on the fullest device, of 79.19). The model adds communication to compute: FSDP prefetches its "
             "gathers behind compute on GPUs, so its estimates here are upper bounds and a speed-up over a written "
             "FSDP plan is at most what is shown."]
    for name in CONFIGS:
        t0 = time.perf_counter()
        written = validate(load_config(name, ["trainer.dry_run=true"]))
        dims = model_dims(written)
        space = enumerate_plans(written, dims)
        ranked = sorted(((estimate(c, dims, H100_ASSUMED), p, c) for p, c in space.plans), key=lambda r: r[0].total)
        mine = estimate(written, dims, H100_ASSUMED)
        best, _, chosen = ranked[0]
        where = next((i for i, (_, _, c) in enumerate(ranked, 1) if describe(c) == describe(written)), None)
        rows = [["chosen: " + describe(chosen), f"{best.total:.1f}",
                 *(f"{best.phases[p]:.1f}" if p in best.phases else "-" for p in PHASES), f"{peak_gib(chosen, dims):.1f}"],
                ["as written: " + describe(written), f"{mine.total:.1f}",
                 *(f"{mine.phases[p]:.1f}" if p in mine.phases else "-" for p in PHASES), f"{peak_gib(written, dims):.1f}"]]
        res = written.resources
        parts += ["", f"### {name} ({res.nodes} x {res.procs_per_node} GPUs; {len(ranked)} plans fit, "
                      f"{len(space.too_big)} do not; {time.perf_counter() - t0:.0f} s)", "",
                  markdown_table(["plan", "s per step", *PHASES, "peak GiB"], rows), "",
                  f"The written plan ranks {where if where else 'outside the enumeration'} of {len(ranked)}; the chosen "
                  f"one is estimated {mine.total / best.total:.2f}x faster."]
        print("\n".join(parts[-4:]), flush=True)
    if not args.no_write:
        write_section(SECTION, "\n".join(parts))


if __name__ == "__main__":
    main()
