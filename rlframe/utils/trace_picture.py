"""A run's trace (trainer.trace, rlframe/utils/trace.py) drawn as a PNG timeline: one lane per driver
thread and per rank of each worker group, a bar per event coloured by its name (calls by method),
nested events (phases inside a step, spans inside a call) as thinner bars on their parent, and
notes you pass at a time and lane.

    python -m rlframe.utils.trace_picture outputs/ppo_tiny/trace.json --out timeline.png --steps 2-3 \\
        --note "step3+0.2|rollout/rank 0|batch 4 generates while step 3 trains"

A note is "WHEN|LANE|TEXT": WHEN is seconds from the picture's left edge ("4.2") or from the start
of a step ("step3+0.2", "step3"), LANE a lane's label as drawn ("driver/driver", "actor/rank 0";
empty: above the top lane).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rlframe.utils.trace import DRIVER, read_trace

SKIPPED = {"run"}  # the whole run: every other driver event is inside it


@dataclass(frozen=True)
class Note:
    seconds: float  # from the picture's left edge, or from the start of `step`
    lane: str  # a lane label; "" for the top
    text: str
    step: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "Note":
        try:
            when, lane, text = spec.split("|", 2)
            step = None
            if when.startswith("step"):
                k, _, when = when[len("step"):].partition("+")
                step = int(k)
            return cls(float(when or 0), lane.strip(), text, step)
        except ValueError:
            raise ValueError(f"--note {spec!r}: write it as WHEN|LANE|TEXT, e.g. '4.2|actor/rank 0|update' "
                             "or 'step3+0.5|actor/rank 0|update'") from None

    def x(self, events: list[dict], left: float) -> float:
        """Seconds from the picture's left edge (`left`, µs)."""
        if self.step is None:
            return self.seconds
        return (step_window(events, self.step, self.step)[0] - left) / 1e6 + self.seconds


def lanes(events: list[dict]) -> list[tuple[int, int, str]]:
    """(pid, tid, label) of every lane that has events, the driver's first, then each group's ranks."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "X" and e["name"] not in SKIPPED}
    order = sorted(used, key=lambda k: (procs.get(k[0]) != DRIVER, k[0], k[1]))
    return [(p, t, f"{procs.get(p, p)}/{threads.get((p, t), t)}") for p, t in order]


def step_window(events: list[dict], first: int, last: int) -> tuple[float, float]:
    """The wall-clock span (µs) from step `first`'s start to step `last`'s end (the driver's "step" spans)."""
    spans = {e["args"].get("step"): e for e in events if e.get("ph") == "X" and e["name"] == "step"}
    missing = [s for s in (first, last) if s not in spans]
    if missing:
        raise ValueError(f"the trace has no step {missing[0]} (its steps: {sorted(k for k in spans if k is not None)})")
    return spans[first]["ts"], spans[last]["ts"] + spans[last]["dur"]


def _nesting(bars: list[dict]) -> tuple[list[int], set[int]]:
    """Each event's nesting depth on its lane (an event that starts inside an earlier one and ends by
    its end is its child), and the positions of the events that have children."""
    order = sorted(range(len(bars)), key=lambda i: (bars[i]["ts"], -bars[i]["dur"]))
    depth, stack, parents = [0] * len(bars), [], set()
    for i in order:
        end = bars[i]["ts"] + bars[i]["dur"]
        while stack and bars[stack[-1]]["ts"] + bars[stack[-1]]["dur"] < end:
            stack.pop()
        if stack:
            parents.add(stack[-1])
        depth[i] = len(stack)
        stack.append(i)
    return depth, parents


def render(events: list[dict], out: Path, *, notes: list[Note] = (), window: tuple[float, float] | None = None,
           title: str | None = None, legend_entries: int = 14) -> Path:
    """Draw `events` (as read_trace gives them) into the PNG `out`; `window`: (start, end) in µs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e for e in events if e.get("ph") == "X" and e["name"] not in SKIPPED]
    if not xs:
        raise ValueError("the trace has no events to draw")
    lo, hi = window or (min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs))
    xs = [e for e in xs if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    rows = lanes(events)
    index = {(p, t): i for i, (p, t, _) in enumerate(rows)}
    cmap = plt.get_cmap("tab20")
    colours: dict[str, tuple] = {}
    totals: dict[str, float] = {}
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.6))
    for (pid, tid), row in index.items():
        bars = [e for e in xs if (e["pid"], e["tid"]) == (pid, tid)]
        depths, parents = _nesting(bars)
        for i in sorted(range(len(bars)), key=lambda i: depths[i]):  # parents first, children on top
            e, depth = bars[i], depths[i]
            colour = colours.setdefault(e["name"], cmap(len(colours) % 20))
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
            start, width = (max(e["ts"], lo) - lo) / 1e6, (min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) / 1e6
            height = max(0.2, 0.8 - 0.2 * depth)
            ax.barh(row, width, left=start, height=height, color=colour, edgecolor="black", linewidth=0.3)
            if width > (hi - lo) / 1e6 / 25 and i not in parents:  # a parent's name would be under its children
                ax.text(start + width / 2, row, e["name"], ha="center", va="center", fontsize=6, clip_on=True)
    labels = [label for _, _, label in rows]
    for note in notes:
        if note.lane and note.lane not in labels:
            raise ValueError(f"note {note.text!r}: no lane {note.lane!r}; the lanes are {labels}")
        y, x = labels.index(note.lane) if note.lane else -0.9, note.x(events, lo)
        ax.annotate(note.text, xy=(x, y), xytext=(x, y - 0.6), fontsize=8,
                    arrowprops={"arrowstyle": "->", "lw": 0.8}, ha="left", va="bottom",
                    bbox={"boxstyle": "round,pad=0.2", "fc": "lightyellow", "lw": 0.5})
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -1.6)
    ax.set_xlim(0, (hi - lo) / 1e6)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    top = sorted(totals, key=totals.get, reverse=True)[:legend_entries]
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in top], labels=top, fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlframe.utils.trace_picture", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a trace.json a run with trainer.trace=true wrote")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--steps", default=None, help="FIRST-LAST: draw only these steps (the driver's step spans)")
    p.add_argument("--note", action="append", default=[], help="WHEN|LANE|TEXT (repeatable): WHEN is SECONDS "
                   "from the left edge or stepN+SECONDS from step N's start")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    events = read_trace(args.trace)
    window = None
    if args.steps:
        first, _, last = args.steps.partition("-")
        window = step_window(events, int(first), int(last or first))
    out = render(events, args.out, notes=[Note.parse(n) for n in args.note], window=window, title=args.title)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
