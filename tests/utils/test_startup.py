"""The start-up breakdown counts from the process's real start."""

import subprocess
import sys
import time

from rlframe.utils import startup

CHILD = "import time; from rlframe.utils.startup import process_start; print(process_start(), time.time())"


def test_process_start_is_when_the_process_started():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True).stdout
    started, now = map(float, out.split())
    # Exact to a clock tick (10 ms); psutil's create_time was up to a second early (whole-second boot time).
    assert before - 0.02 <= started <= now


def test_breakdown_stages_add_up_from_the_process_start():
    startup.reset()
    startup.mark("a")
    startup.mark("b")
    startup.mark("a")
    stages = startup.breakdown()
    assert list(stages) == ["a", "b"]
    assert all(v >= 0 for v in stages.values())
    assert abs(sum(stages.values()) - (startup._marks[-1][1] - startup.process_start())) < 0.02  # one clock tick
    metrics = startup.metrics()
    assert set(metrics) == {"timing_s/startup/a", "timing_s/startup/b", "timing_s/startup/total"}
    assert startup.summary().startswith("start-up ")
    startup.reset()
