"""The start-up check of bf16 on CPU: both matmul rates measured, and the advice given the rates."""

from rlframe.config.schema import RunConfig
from rlframe.controller import cpu_precision
from rlframe.utils import startup


def test_matmul_rates_are_two_positive_numbers():
    fp32, bf16 = startup.matmul_rates(n=64, repeats=2)
    assert fp32 > 0 and bf16 > 0


def test_advice_says_bf16_is_slower_and_what_to_set():
    line = cpu_precision.bf16_advice(321.0, 172.0, ["actor.precision", "critic.precision"])
    assert "bf16 is slower than fp32 on this CPU" in line
    assert "fp32 321 GFLOP/s" in line and "bf16 172 GFLOP/s" in line
    assert "actor.precision=fp32 critic.precision=fp32" in line


def test_advice_when_bf16_is_faster_only_reports_the_rates():
    line = cpu_precision.bf16_advice(225.0, 974.0, ["actor.precision"])
    assert "slower" not in line and "=fp32" not in line
    assert "fp32 225 GFLOP/s" in line and "bf16 974 GFLOP/s" in line


def test_only_cpu_runs_with_bf16_roles_are_checked(monkeypatch):
    cfg = RunConfig()
    assert cpu_precision.bf16_roles(cfg) == []  # auto is fp32 on CPU
    cfg.actor.precision = "bf16"
    cfg.critic.precision = "bf16"
    assert cpu_precision.bf16_roles(cfg) == ["actor.precision", "critic.precision"]  # ppo with gae: critic used
    cfg.algorithm.adv_estimator = "grpo"
    assert cpu_precision.bf16_roles(cfg) == ["actor.precision"]  # no critic in this run
    cfg.resources.use_gpu = True
    assert cpu_precision.bf16_roles(cfg) == []


def test_check_emits_one_line_from_the_measured_rates(monkeypatch):
    monkeypatch.setattr(cpu_precision, "matmul_rates", lambda: (300.0, 150.0))
    cfg = RunConfig()
    cfg.actor.precision = "bf16"
    lines = []
    assert cpu_precision.check_cpu_precision(cfg, emit=lines.append) == lines[0]
    assert len(lines) == 1 and "bf16 is slower than fp32" in lines[0]
    cfg.actor.precision = "auto"
    assert cpu_precision.check_cpu_precision(cfg, emit=lines.append) is None and len(lines) == 1
