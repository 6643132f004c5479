"""Where a run's metrics go: console, metrics.jsonl, TensorBoard, wandb/mlflow, and a PNG plot; and
where its generations go (generations/*.jsonl, and their first rows to TensorBoard, wandb, mlflow).

One `Tracker.log(metrics, step)` call per training step writes to every configured sink. Metric
names follow verl's (`critic/score/mean`, `timing_s/gen`, `perf/throughput`, ...), so existing
dashboards and scripts work. Non-finite values are written as NaN (metrics.jsonl uses JSON's
`NaN` extension, which Python's json and pandas read), counted, and stop the run when they persist
(`nonfinite.py`, `trainer.max_nonfinite_steps`).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

from rlframe.config.ranges import SINKS
from rlframe.utils.console import say
from rlframe.controller.lifecycle.nonfinite import NonFiniteGuard
from rlframe.controller.lifecycle.step_files import RotatingJsonl, read_jsonl, trim_jsonl
from rlframe.utils import metrics_endpoint, trace

PLOT_EVERY_S = 30.0  # curves.png is redrawn at most this often during a run, and at its end
PLOTTED = (("critic/score/mean", "reward (mean score)"), ("val/accuracy", "held-out accuracy"),
           ("response_length/mean", "response length"), ("actor/reference_kl", "KL(policy || reference)"))
GENERATION_KINDS = ("train", "val")  # generations/<kind>.jsonl (controller/trainers/generations.py)
SINK_ROWS = 4  # a dump's first rows that also go to TensorBoard, wandb and mlflow
SINK_CHARS = 400  # of a prompt or response shown there (the jsonl rows hold all of it)


class RunFilesWriteFailed(RuntimeError):
    """A run file (metrics.jsonl, TensorBoard events, curves.png) could not be written because the disk
    is full: the run ends with one line, like a checkpoint that does not fit."""


def _writer_thread_disk_full(args) -> bool:
    """A threading.excepthook's args: TensorBoard's writer thread failed for a full disk (or quota)."""
    import errno

    return (type(args.thread).__module__.startswith("tensorboard.") and isinstance(args.exc_value, OSError)
            and args.exc_value.errno in (errno.ENOSPC, errno.EDQUOT))


def _quiet_full_disk_in_writer_threads() -> None:
    """TensorBoard's writer thread keeps its write error for the writer, whose flush() raises it in the
    driver (where `_disk_errors` ends the run with one line), then raises it again in the thread, which
    printed its own traceback first ("Exception in thread ... event_file_writer.py"): a full disk's is
    not printed (threading.excepthook, installed once; every other thread's error is as before)."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "rlframe_quiet_full_disk", False):
        return

    def hook(args):
        if not _writer_thread_disk_full(args):
            previous(args)

    hook.rlframe_quiet_full_disk = True
    threading.excepthook = hook


def _numeric(metrics: dict) -> dict[str, float]:
    """Numbers as floats, every non-finite one as NaN (inf would not survive every sink)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)):
            out[k] = float(v) if math.isfinite(float(v)) else math.nan
    return out


class Tracker:
    """`config` is the run's config as a dict; its `trainer.max_nonfinite_steps` arms the guard."""

    def __init__(self, run_dir: Path, *, sinks: list[str], experiment: str, config: dict, plot: bool = True):
        unknown = [s for s in sinks if s not in SINKS]
        if unknown:
            raise ValueError(f"trainer.loggers has unknown sinks {unknown}; choose from {SINKS}")
        self.run_dir, self.sinks, self.plot_enabled = Path(run_dir), list(sinks), plot
        self.history: list[dict] = []
        # first drawn PLOT_EVERY_S into the run, not at its first log: importing matplotlib and drawing
        # took 0.6 s of the start-up when step 0's validation was logged
        self._plotted_at = time.monotonic()
        self.jsonl = self.run_dir / "metrics.jsonl"
        trainer = config.get("trainer") or {}
        self.guard = NonFiniteGuard(max_in_a_row=trainer.get("max_nonfinite_steps"))
        max_bytes = int(float(trainer.get("rollout_dump_max_mb", 100.0)) * 2**20)
        self.generations = {kind: RotatingJsonl(self.run_dir / "generations", kind, max_bytes=max_bytes)
                            for kind in GENERATION_KINDS}
        self._tb = self._wandb = self._mlflow = None
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            # its writer thread takes events through a queue of 10 by default: a step's ~60 scalars
            # then wait on the file writes in the driver's step (1.4 ms per step on the demo)
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), max_queue=1000)
            _quiet_full_disk_in_writer_threads()
        if "wandb" in sinks:
            import wandb

            self._wandb = wandb.init(project="rlframe", name=experiment, config=config, dir=str(self.run_dir))
        if "mlflow" in sinks:
            import mlflow

            mlflow.set_experiment(experiment)
            self._mlflow = mlflow.start_run()
            mlflow.log_params({k: str(v)[:250] for k, v in _flatten(config).items()})

    def resume_history(self, upto_step: int) -> None:
        """Keep the lines of steps <= upto_step in metrics.jsonl and generations/*.jsonl (a resumed
        run rewrites what follows; -1 starts the files afresh)."""
        with self._disk_errors(upto_step):
            trim_jsonl(self.jsonl, upto_step)
            for files in self.generations.values():
                files.trim(upto_step)
        self.history = read_jsonl(self.jsonl)

    def log(self, metrics: dict, step: int) -> None:
        """Write one step to every sink; NonFiniteTrainingError (after writing) when too many steps
        in a row were non-finite."""
        row = {"step": step, **_numeric(metrics)}
        row.update(self.guard.observe(step, metrics))
        self.history.append(row)
        metrics_endpoint.publish(row)  # trainer.prometheus_port: the latest step at /metrics
        with self._disk_errors(step):
            self._write_files(row, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in row.items() if k != "step"}, step=step)
        self.guard.raise_if_exceeded()

    def log_generations(self, kind: str, rows: list[dict], step: int) -> None:
        """Append a dump's rows to generations/<kind>.jsonl; its first SINK_ROWS rows also go to
        TensorBoard (text: a markdown table), wandb (a Table) and mlflow (an artifact) when on."""
        if not rows:
            return
        with self._disk_errors(step):
            self.generations[kind].append(rows)
            if self._tb is not None:
                self._tb.add_text(f"generations/{kind}", markdown_table(rows[:SINK_ROWS]), step)
                self._tb.flush()
        if self._wandb is not None:
            import wandb

            columns, data = generation_table(rows[:SINK_ROWS])
            self._wandb.log({f"generations/{kind}": wandb.Table(columns=columns, data=data)}, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_text("".join(json.dumps(r, default=str) + "\n" for r in rows[:SINK_ROWS]),
                            f"generations/{kind}/step_{step:06d}.jsonl")

    def _write_files(self, row: dict, step: int) -> None:
        trace.flush()  # trainer.trace: the step's events reach trace.json
        if "jsonl" in self.sinks:
            with self.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if self._tb is not None:  # its writer thread's errors come back from flush()
            for k, v in row.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        # Redrawing costs about 0.15 s: at most every PLOT_EVERY_S while running, and once at close().
        if self.plot_enabled and time.monotonic() - self._plotted_at >= PLOT_EVERY_S:
            self.plot()
            self._plotted_at = time.monotonic()

    @contextmanager
    def _disk_errors(self, step: int):
        """A full disk ends the run with one line naming the directory (RunFilesWriteFailed), never as a
        traceback from a writer thread; other errors pass."""
        import errno

        try:
            yield
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._tb = None  # its thread cannot write either: close() must not try again
            raise RunFilesWriteFailed(
                f"step {step}: the run's files could not be written in {self.run_dir}: the disk is full ({err.strerror}); "
                "the metrics of earlier steps are in metrics.jsonl; free space and run the same command again to resume "
                "from the newest checkpoint") from None

    def plot(self) -> None:
        """Redraw curves.png from the history (the main curves, one panel each)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [(k, title) for k, title in PLOTTED if any(k in r for r in self.history)]
        if not panels:
            return
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
        for ax, (key, title) in zip(axes[0], panels):
            pts = [(r["step"], r[key]) for r in self.history if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = self.run_dir / ".curves.png.tmp"
        fig.savefig(tmp, dpi=80, format="png")
        plt.close(fig)
        tmp.replace(self.run_dir / "curves.png")

    def close(self) -> None:
        with self._disk_errors(len(self.history)):
            if self.plot_enabled:
                self.plot()
            if self._tb is not None:
                self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()


GENERATION_COLUMNS = ("step", "index", "uid", "reward", "advantage", "response_length", "finished", "policy_version",
                      "prompt", "response")


def generation_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """The columns a dashboard shows of generation rows, and their values (texts cut to SINK_CHARS)."""
    return list(GENERATION_COLUMNS), [[_cut(r.get(c)) for c in GENERATION_COLUMNS] for r in rows]


def _cut(v):
    return v[:SINK_CHARS] + "..." if isinstance(v, str) and len(v) > SINK_CHARS else v


def markdown_table(rows: list[dict]) -> str:
    """generation_table as markdown (TensorBoard's text plugin renders it)."""
    columns, data = generation_table(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in data])


def _markdown_cell(v) -> str:
    text = f"{v:.4g}" if isinstance(v, float) else str(v)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def format_console(step: int, total: int, metrics: dict) -> str:
    keys = [("critic/score/mean", "reward"), ("val/accuracy", "val_acc"), ("response_length/mean", "len"),
            ("actor/pg_loss", "pg_loss"), ("actor/reference_kl", "ref_kl"), ("actor/ppo_kl", "ppo_kl"),
            ("timing_s/step", "s/step")]
    parts = [f"{short}={console_number(metrics[k])}" for k, short in keys if k in metrics]
    return f"step {step}/{total} " + " ".join(parts)


def console_number(value) -> str:
    """A metric for the console: 3 decimals, or where they would show (almost) nothing, 2 significant
    digits (`-1.2e-04`, not `-0.000`); exactly 0 is `0`."""
    v = float(value)
    if v == 0:
        return "0"
    if not math.isfinite(v) or abs(v) >= 0.01:
        return f"{v:.3f}"
    return f"{v:.1e}"


class progress:
    """A tqdm bar with the live reward (or one console line per step when disabled / not a TTY)."""

    def __init__(self, *, total: int, initial: int, enabled: bool):
        import sys

        self.total = total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="rl steps", dynamic_ncols=True)
        self.step = initial

    def update(self, metrics: dict) -> None:
        self.step += 1
        if self.bar is None:
            say(format_console(self.step, self.total, metrics))
            return
        post = {k: console_number(metrics[m]) for k, m in (("reward", "critic/score/mean"), ("val_acc", "val/accuracy"),
                                                      ("ref_kl", "actor/reference_kl")) if m in metrics}
        self.bar.set_postfix(post)
        self.bar.update(1)
        if "val/accuracy" in metrics:
            self.bar.write(format_console(self.step, self.total, metrics))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
