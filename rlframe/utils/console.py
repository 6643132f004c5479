"""The run's console lines: `say("...")` prints `[rlframe] ...` at once (the trainer's modules and the
tracker share it; it imports nothing of theirs)."""

from __future__ import annotations


def say(message: str) -> None:
    print(f"[rlframe] {message}", flush=True)
