"""A local Ray cluster owned by one Python object: `ray start --head --block` in its own process group.

Why not `ray start --head` + `ray stop`: `ray stop` terminates *every* Ray process on the machine
(it matches process names), so on a shared machine it also kills other people's clusters and test
sessions. A cluster started here runs `ray start --block` as a child process; `LocalCluster.stop()`
terminates that process group only, which shuts down exactly this cluster's GCS, raylet, dashboard
and workers.

Every port is picked free (none of the defaults 6379/8265/52365/...), the dashboard listens on
127.0.0.1, and `--temp-dir` is private, so `ray.init()` elsewhere on the machine (which looks for
the latest cluster in /tmp/ray/ray_current_cluster) never joins this cluster by accident.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlframe.utils.ports import free_ports

# Flags of `ray start` that each open one listening port; all are set to free ports.
_PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
               "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
               "--node-manager-port", "--object-manager-port")


class LocalCluster:
    """A running `ray start --head --block` process; `address` is its job-submission (dashboard) URL.

    Example:
        >>> cluster = start_local_cluster(num_cpus=16)
        >>> handle = rlframe.jobs.submit("grpo_tiny", address=cluster.address)
        >>> cluster.stop()
    """

    def __init__(self, proc: subprocess.Popen, *, address: str, gcs_address: str, temp_dir: str, log_path: Path):
        self.proc, self.address, self.gcs_address = proc, address, gcs_address
        self.temp_dir, self.log_path = temp_dir, log_path
        self._owns_temp_dir = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_lines: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-n_lines:])

    def stop(self, *, grace_s: float = 30.0) -> None:
        """Stop this cluster only (the per-cluster `ray stop`): SIGTERM to the head, SIGKILL after `grace_s`.

        `ray start --block` answers SIGTERM by shutting down the processes it started (about 10 s
        here); whatever is left in its process group is then killed.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=5)
        if self._owns_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalCluster(address={self.address!r}, gcs={self.gcs_address!r}, alive={self.alive()})"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_local_cluster(*, num_cpus: int = 16, env: dict[str, str] | None = None, temp_dir: str | None = None,
                        timeout_s: float = 90.0) -> LocalCluster:
    """Start a one-node Ray cluster with its dashboard on 127.0.0.1 and wait until it accepts jobs.

    num_cpus: logical CPUs to advertise; rlframe's workers mostly wait on each other, so a 2-core
        machine still needs about 16 to place a tiny run's worker groups (see single_controller/ray_utils.py).
    env: extra environment for the cluster's processes (e.g. RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH).
    temp_dir: Ray's session directory (logs, sockets; keep it short: socket paths are limited to 108
        bytes), created if missing and left in place by `stop()`; None: a new /tmp/rlf_ray_* removed by `stop()`.
    Raises RuntimeError with the tail of `ray start`'s output if the cluster does not come up.
    """
    # Unix socket paths under the temp dir must stay short (108 bytes), hence /tmp and a short prefix.
    owns_temp_dir = temp_dir is None
    if temp_dir is not None:  # a directory of the caller's: made when missing (Ray wants an absolute path), kept at stop
        temp_dir = str(Path(temp_dir).expanduser().absolute())
        Path(temp_dir).mkdir(parents=True, exist_ok=True)
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="rlf_ray_", dir="/tmp")
    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
    # Worker ports: 200 from 20000-29999, below free_ports()' range (30000-32767) and the ephemeral
    # range (32768+), above Ray's default 10002-19999, so neither this cluster's other ports nor
    # another cluster's workers collide with them.
    lo = random.randrange(20000, 29800)
    cmd = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())",
           "start", "--head", "--block", "--disable-usage-stats", f"--num-cpus={num_cpus}",
           "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
           f"--min-worker-port={lo}", f"--max-worker-port={lo + 200}"]
    cmd += [f"{flag}={port}" for flag, port in ports.items()]
    log_path = Path(temp_dir) / "ray_start.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    cluster = LocalCluster(proc, address=f"http://127.0.0.1:{ports['--dashboard-port']}",
                           gcs_address=f"127.0.0.1:{ports['--port']}", temp_dir=temp_dir, log_path=log_path)
    cluster._owns_temp_dir = owns_temp_dir
    try:
        _wait_ready(cluster, env=env or {}, timeout_s=timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_ready(cluster: LocalCluster, *, env: dict[str, str], timeout_s: float) -> None:
    """Poll the dashboard's job API (with the token the cluster was started with) until it answers 200."""
    import requests

    from rlframe.jobs.auth import auth_headers

    headers = auth_headers({**os.environ, **env})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not cluster.alive():
            raise RuntimeError(f"`ray start --head` exited with code {cluster.proc.returncode}:\n{cluster.log_tail()}")
        try:
            if requests.get(f"{cluster.address}/api/version", headers=headers, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the Ray dashboard at {cluster.address} did not answer within {timeout_s:.0f} s; "
                       f"`ray start` output:\n{cluster.log_tail()}")
