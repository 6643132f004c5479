"""What machine this is, for measurements and build records."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (e.g. "AMD EPYC"); rates differ by CPU model, so every
    benchmark table names it. Falls back to platform.processor() / machine() where /proc is absent."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
