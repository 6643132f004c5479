"""The per-step console line: small losses and KLs show their significant digits, not `-0.000`."""

from rlframe.controller.lifecycle.tracking import console_number, format_console


def test_small_values_keep_significant_digits():
    line = format_console(3, 60, {"critic/score/mean": 0.4375, "actor/pg_loss": -1.234e-4, "actor/ppo_kl": 3.1e-7,
                                  "actor/reference_kl": 0.0, "response_length/mean": 6.5, "timing_s/step": 1.25})
    assert line == "step 3/60 reward=0.438 len=6.500 pg_loss=-1.2e-04 ref_kl=0 ppo_kl=3.1e-07 s/step=1.250"


def test_console_number():
    assert [console_number(v) for v in (0.0, -0.0, 0.01, -0.0099, 0.0005, 12.3456, 2e6, float("nan"), 3)] == \
        ["0", "0", "0.010", "-9.9e-03", "5.0e-04", "12.346", "2000000.000", "nan", "3.000"]
