"""The job client: submit the main job to a Ray job server, attach to it, follow its status, logs and metrics.

See the package docstring (rlframe/jobs/__init__.py) for the dataflow and the file-system assumption.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator, Sequence
from urllib.parse import urlparse

from rlframe.jobs.auth import auth_headers, authentication_mode, find_token, resolve_address
from rlframe.jobs.cluster import LocalCluster, start_local_cluster

__all__ = ["submit", "attach", "connect", "JobHandle", "ClusterNotFoundError", "JobFailedError",
           "LocalCluster", "start_local_cluster", "TERMINAL_STATES"]

REPO_ROOT = Path(__file__).resolve().parents[2]
TERMINAL_STATES = ("SUCCEEDED", "FAILED", "STOPPED")
_META_RUN_DIR, _META_CONFIG = "rlframe_run_dir", "rlframe_config"
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


class ClusterNotFoundError(ConnectionError):
    """Nothing answers at the job-submission address."""


class JobFailedError(RuntimeError):
    """The job ended FAILED or STOPPED; `.status`, `.log_tail` and `.job_id` say more."""

    def __init__(self, job_id: str, status: str, message: str, log_tail: str):
        self.job_id, self.status, self.log_tail = job_id, status, log_tail
        super().__init__(f"job {job_id} ended {status}: {message}\n--- last lines of its log ---\n{log_tail}")


# Ports of a Ray head that do not serve the job API (Ray's defaults): the GCS and the Ray client server.
_NOT_JOB_PORTS = {6379: "the GCS port (what `ray start --address` and RAY_ADDRESS take)",
                  10001: "the Ray client port (ray://)"}


def _listens(address: str) -> bool:
    """Whether a TCP connection to the address's host:port succeeds (something is there, just not a job server)."""
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(address)
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def _how_to_start(address: str) -> str:
    from urllib.parse import urlsplit

    try:
        port = urlsplit(address).port
    except ValueError:
        port = None
    if port in _NOT_JOB_PORTS or _listens(address):
        what = f"{port} is {_NOT_JOB_PORTS[port]}" if port in _NOT_JOB_PORTS else \
            "something listens there but does not serve Ray's job API (a GCS or Ray client port?)"
        return (f"no Ray job server answers at {address}: {what}. Jobs are submitted to the cluster's "
                "dashboard URL, http://<head-ip>:8265 by default "
                "(`ray start --head` prints it; the dashboard listens only on 127.0.0.1 unless started with "
                "--dashboard-host=0.0.0.0): pass that as address=... / --address / RAY_API_SERVER_ADDRESS")
    return (f"no Ray cluster answers at {address}. Start one on this machine with "
            f"`ray start --head --dashboard-host 127.0.0.1` (job server at {resolve_address(None)}) or, "
            "from Python, `rlframe.jobs.start_local_cluster()`; or pass the dashboard URL of a running "
            "cluster as address=... / RAY_API_SERVER_ADDRESS")


def connect(address: str | None = None):
    """A `ray.job_submission.JobSubmissionClient` for `address`, authenticated when the cluster needs it.

    Raises ClusterNotFoundError (with how to start a cluster) when nothing answers, and
    PermissionError (with where the token was looked for) when the cluster wants a token we lack.
    """
    import requests
    from ray.job_submission import JobSubmissionClient

    address = resolve_address(address)
    try:
        mode = authentication_mode(address)
    except requests.RequestException as err:
        raise ClusterNotFoundError(_how_to_start(address)) from err
    token, where = find_token()
    if mode == "token" and token is None:
        raise PermissionError(
            f"the cluster at {address} uses token authentication but no token was found {where}. Copy the "
            "cluster's token (`ray get-auth-token` on its head node) to ~/.ray/auth_token, or set "
            "RAY_AUTH_TOKEN_PATH to a file holding it, or RAY_AUTH_TOKEN to the token")
    from ray.exceptions import AuthenticationError

    try:
        return JobSubmissionClient(address, headers=auth_headers())
    except AuthenticationError as err:
        raise PermissionError(f"the cluster at {address} rejected the token from {where}: it is not this "
                              "cluster's token (`ray get-auth-token` on its head node prints the right one)") from err
    except ConnectionError as err:
        raise ClusterNotFoundError(_how_to_start(address)) from err


def _quote_override_value(override: str) -> str:
    """Hydra's override grammar rejects spaces and some symbols unquoted; quote such values."""
    key, _, value = override.partition("=")
    return override if re.fullmatch(r"[\w./:@+-]*", value) else f"{key}='{value}'"


def _plan_run(config_name: str, overrides: list[str], output_dir: str | None) -> tuple[list[str], Path]:
    """Validate the config here and return (overrides with an absolute output_dir, run dir)."""
    from rlframe.config import ConfigError
    from rlframe.plan.command import planned_config

    try:  # with trainer.auto_plan the job plans on the cluster: here only that a plan exists
        cfg = planned_config(config_name, overrides, log=lambda line: None)
    except ConfigError as err:
        raise ValueError(f"config {config_name!r} with overrides {overrides} is invalid: {err}") from err
    # The job's working directory on the cluster is Ray's, not ours: a relative output_dir would
    # land somewhere the handle cannot find, so pin it to an absolute path.
    out = Path(output_dir or cfg.trainer.output_dir).expanduser().absolute()
    kept = [o for o in overrides if not o.lstrip("+").startswith("trainer.output_dir=")]
    return kept + [_quote_override_value(f"trainer.output_dir={out}")], out / cfg.trainer.experiment


def _runtime_env(address: str, user_env: dict | None) -> dict:
    # The trainer's own ray.init(runtime_env=...) sets env vars (PYTHONPATH) that this job env also
    # sets; Ray refuses to merge the two unless told that the driver's values win (merged key by key).
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}
    if urlparse(address).hostname in _LOCAL_HOSTS:
        # Same machine: run this checkout's code, whatever the cluster's default path holds.
        env_vars["PYTHONPATH"] = str(REPO_ROOT)
    runtime_env = dict(user_env or {})
    runtime_env["env_vars"] = {**env_vars, **runtime_env.get("env_vars", {})}
    return runtime_env


def submit(config_name: str = "ppo_tiny", overrides: Sequence[str] = (), *, address: str | None = None,
           output_dir: str | None = None, runtime_env: dict | None = None, python: str | None = None,
           entrypoint_num_cpus: float = 0, submission_id: str | None = None) -> "JobHandle":
    """Submit `python -m rlframe.main --config-name CONFIG_NAME OVERRIDES...` as a Ray job.

    overrides: Hydra `key=value` strings, e.g. ["trainer.total_steps=2"].
    address: the cluster's job server (dashboard) URL; default RAY_API_SERVER_ADDRESS or 127.0.0.1:8265.
    output_dir: where runs go (absolute; on shared storage for a remote cluster); default the
        config's trainer.output_dir made absolute against the current directory.
    runtime_env: merged over rlframe's (env_vars merged key by key), e.g. {"working_dir": "."} to ship code.
    python: interpreter of the entrypoint; default this interpreter for a local cluster, else `python`.
    entrypoint_num_cpus: CPUs the driver reserves; 0 because the trainer's workers reserve their own.
    Raises ValueError for an unknown config or a bad override, ClusterNotFoundError without a cluster.
    """
    overrides = list(overrides)
    address = resolve_address(address)
    overrides, run_dir = _plan_run(config_name, overrides, output_dir)
    client = connect(address)
    if python is None:
        python = sys.executable if urlparse(address).hostname in _LOCAL_HOSTS else "python"
    entrypoint = shlex.join([python, "-m", "rlframe.main", "--config-name", config_name, *overrides])
    job_id = client.submit_job(
        entrypoint=entrypoint, runtime_env=_runtime_env(address, runtime_env),
        submission_id=submission_id or f"rlframe-{config_name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
        metadata={_META_RUN_DIR: str(run_dir), _META_CONFIG: config_name}, entrypoint_num_cpus=entrypoint_num_cpus)
    return JobHandle(client, job_id, run_dir=run_dir, config_name=config_name)


def submit_command(entrypoint: str, *, run_dir: str | Path | None = None, address: str | None = None,
                   runtime_env: dict | None = None, submission_id: str | None = None) -> "JobHandle":
    """Submit any shell command as a job and follow it like a run (metrics from `run_dir`, if given)."""
    address = resolve_address(address)
    client = connect(address)
    run_dir = Path(run_dir).absolute() if run_dir is not None else None
    metadata = {_META_RUN_DIR: str(run_dir)} if run_dir is not None else {}
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=_runtime_env(address, runtime_env),
                               submission_id=submission_id, metadata=metadata)
    return JobHandle(client, job_id, run_dir=run_dir)


def attach(job_id: str, *, address: str | None = None) -> "JobHandle":
    """A handle for an existing job (e.g. submitted from another process or by the CLI)."""
    client = connect(address)
    try:
        info = client.get_job_info(job_id)
    except RuntimeError as err:
        recent = ", ".join(j.submission_id or j.job_id or "?" for j in client.list_jobs()[-5:]) or "none"
        raise ValueError(f"no job {job_id!r} on the cluster at {client.get_address()}; recent jobs: {recent}") from err
    meta = info.metadata or {}
    run_dir = Path(meta[_META_RUN_DIR]) if meta.get(_META_RUN_DIR) else None
    return JobHandle(client, job_id, run_dir=run_dir, config_name=meta.get(_META_CONFIG))


def read_metrics(run_dir: Path | None) -> list[dict]:
    """Rows of `run_dir/metrics.jsonl` (each {"step": int, name: float, ...}); [] before the first step.

    The trainer appends one line per step while we read, so a last line that does not parse yet
    is a write in progress and is skipped; a bad line elsewhere is a real error.
    """
    path = None if run_dir is None else Path(run_dir) / "metrics.jsonl"
    if path is None or not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
    return rows


class JobHandle:
    """Status, logs, metrics and stop for one submitted job. Every call asks the job server anew."""

    def __init__(self, client, job_id: str, *, run_dir: Path | None, config_name: str | None = None):
        self.client, self.job_id, self.run_dir, self.config_name = client, job_id, run_dir, config_name

    @property
    def address(self) -> str:
        return self.client.get_address()

    def __repr__(self) -> str:
        return f"JobHandle(job_id={self.job_id!r}, address={self.address!r}, run_dir={str(self.run_dir)!r})"

    def status(self) -> str:
        """One of PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED."""
        return str(self.client.get_job_status(self.job_id).value)

    def done(self) -> bool:
        return self.status() in TERMINAL_STATES

    def info(self):
        """Ray's JobDetails: entrypoint, status, message, start/end times, metadata."""
        return self.client.get_job_info(self.job_id)

    def logs(self) -> str:
        """Everything the job printed so far (stdout and stderr)."""
        return self.client.get_job_logs(self.job_id)

    def log_tail(self, n_lines: int = 40) -> str:
        return "\n".join(self.logs().splitlines()[-n_lines:])

    def follow_logs(self, *, poll_s: float = 1.0, timeout_s: float | None = None) -> Iterator[str]:
        """Yield new log text as it appears until the job ends (polling: works inside a running event loop)."""
        seen, deadline = 0, None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            finished = self.done()
            text = self.logs()
            if len(text) > seen:
                yield text[seen:]
                seen = len(text)
            if finished or (deadline is not None and time.monotonic() > deadline):
                return
            time.sleep(poll_s)

    def wait(self, *, timeout_s: float | None = None, poll_s: float = 1.0, raise_on_failure: bool = True) -> str:
        """Block until the job ends; return its final status.

        Raises JobFailedError (with the log tail) if it ended FAILED/STOPPED and raise_on_failure,
        TimeoutError if it is still running after timeout_s.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (status := self.status()) not in TERMINAL_STATES:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} is still {status} after {timeout_s} s; "
                                   f"last log lines:\n{self.log_tail(10)}")
            time.sleep(poll_s)
        if raise_on_failure and status != "SUCCEEDED":
            raise JobFailedError(self.job_id, status, self.info().message or "", self.log_tail())
        return status

    def stop(self, *, wait_s: float = 30.0) -> str:
        """Ask Ray to stop the job (SIGTERM, then SIGKILL) and wait up to wait_s for it to end."""
        if not self.done():
            self.client.stop_job(self.job_id)
        deadline = time.monotonic() + wait_s
        while (status := self.status()) not in TERMINAL_STATES and time.monotonic() < deadline:
            time.sleep(0.5)
        return status

    def metrics(self) -> list[dict]:
        """The run's metrics.jsonl rows so far (see the module docstring for where they are read)."""
        return read_metrics(self.run_dir)

    def metric(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, e.g. "critic/score/mean", over the rows that have it."""
        rows = [r for r in self.metrics() if name in r]
        return [int(r["step"]) for r in rows], [float(r[name]) for r in rows]
