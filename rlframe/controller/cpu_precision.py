"""Start-up advice for a CPU run in bf16: measured, not read from CPU flags.

`check_cpu_precision(cfg)` (called by rlframe.main before anything starts) measures this CPU's fp32
and bf16 matmul rates when a CPU run asks for bf16, and says so when bf16 is the slower.
"""

from __future__ import annotations

from rlframe.utils.startup import matmul_rates


def bf16_advice(fp32_gflops: float, bf16_gflops: float, roles: list[str]) -> str:
    """The line printed at start-up for a CPU run with `roles` in bf16: the measured rates and, when
    bf16 is the slower, that it is and what to set instead."""
    rates = f"matmul on this CPU: fp32 {fp32_gflops:.0f} GFLOP/s, bf16 {bf16_gflops:.0f} GFLOP/s"
    if bf16_gflops >= fp32_gflops:
        return f"rlframe: {', '.join(roles)} in bf16; {rates} (bf16 is the faster here)"
    fix = " ".join(f"{r}=fp32" for r in roles)
    return (f"rlframe: warning: {', '.join(roles)} in bf16, but bf16 is slower than fp32 on this CPU "
            f"({rates}), so this run will be slower, not faster; set {fix}")


def bf16_roles(cfg) -> list[str]:
    """The `<role>.precision` keys a CPU run of `cfg` sets to bf16 ('auto' is fp32 on CPU)."""
    if cfg.resources.use_gpu:
        return []
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.uses_critic else [])
    return [f"{name}.precision" for name, role in roles if role.precision == "bf16"]


def check_cpu_precision(cfg, emit=print) -> str | None:
    """On a CPU run with a role in bf16, measure both matmul rates and `emit` the advice line."""
    roles = bf16_roles(cfg)
    if not roles:
        return None
    line = bf16_advice(*matmul_rates(), roles)
    emit(line)
    return line
