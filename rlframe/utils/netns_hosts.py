"""Hosts made of Linux network namespaces on this machine, each running a Ray node.

    with NetnsHosts(3, cpus=2) as hosts:           # h0, h1, h2 on a bridge of a private /24
        hosts.start_ray()                          # head in h0, a worker node in h1 and h2
        hosts.run(0, [python, "-m", "rlframe.main", f"ray.address={hosts.ray_address}", ...])
        hosts.kill_node(2)                         # h2's raylet and workers die (a lost machine)
        hosts.start_node(2)                        # it comes back

What makes each namespace a host, as far as the framework can tell:
- its own network: one veth pair to a bridge in the root namespace, an address of the subnet
  10.213.<k>.0/24 on `eth0`, its own loopback, and a default route on eth0 only so that programs
  can find their outward address (the bridge has no address and forwards nowhere: traffic stays
  among the hosts);
- its own /dev/shm (a tmpfs in a mount namespace of its own), so shared memory never crosses hosts,
  as between machines;
- its own hostname (`h0`, `h1`, ...), resolving to 127.0.1.1 as on a stock Debian host (so gloo,
  left alone, would bind loopback: it must be told the interface), and a resolver with no server
  (/etc/netns/<ns>/hosts and resolv.conf, which `ip netns exec` mounts over /etc's), so a name
  lookup fails at once instead of timing out against an unreachable DNS server;
- a Ray node whose temp dir is its own.
Files elsewhere are shared, like the network storage of a cluster; `private_mount(i, path)` hides a
directory from one host (storage that host cannot see).

Each host is a long-lived anchor process (`sleep`) inside the namespaces; commands enter them with
nsenter. Closing (or the interpreter exiting, or a later harness finding the namespaces of a
harness whose process is gone) kills every process in each namespace and deletes the namespaces and
the bridge. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; `unavailable()` says why not.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "rlf"  # names: rlf<pid>h<i> (namespace), rlf<pid>v<i> (root side of the veth), rlf<pid>br
RAY_PORT = 6379
ETC_NETNS = "/etc/netns"  # ip netns exec mounts /etc/netns/<ns>/<file> over /etc/<file>


def unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); CI runs as root"
    for tool in ("ip", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(ns: str) -> list[int]:
    out = _sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_all(ns: str, *, spare: int | None = None, grace_s: float = 3.0) -> None:
    """SIGKILL every process in namespace `ns` but `spare`, until none is left (children a dying
    process spawns included)."""
    deadline = time.monotonic() + grace_s + 10
    while True:
        pids = [p for p in _pids_in(ns) if p != spare]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _remove(owner: int) -> None:
    """Everything a harness of process `owner` made: its processes, namespaces and bridge."""
    stem = f"{PREFIX}{owner}"
    for ns in _namespaces():
        if ns.startswith(stem + "h"):
            _kill_all(ns)
            _sh("ip", "netns", "del", ns, check=False)
    for etc in Path(ETC_NETNS).glob(f"{stem}h*"):
        shutil.rmtree(etc, ignore_errors=True)
    _sh("ip", "link", "del", f"{stem}br", check=False)


def _owner(name: str, sep: str) -> int | None:
    """The pid in a name `rlf<pid><sep>...` this module gives its namespaces, files and bridges."""
    rest = name[len(PREFIX):]
    head = rest.split(sep, 1)[0]
    return int(head) if name.startswith(PREFIX) and sep in rest and head.isdigit() else None


def sweep_stale() -> list[int]:
    """Remove what harnesses of processes that no longer exist left behind (a killed test run):
    namespaces, their /etc/netns entries and bridges."""
    links = _sh("ip", "-o", "link", "show", "type", "bridge", check=False).stdout
    names = ([(ns, "h") for ns in _namespaces()] + [(p.name, "h") for p in Path(ETC_NETNS).glob(f"{PREFIX}*")]
             + [(line.split(":")[1].strip(), "br") for line in links.splitlines() if ":" in line])
    owners = {o for name, sep in names if (o := _owner(name, sep)) is not None}
    stale = [o for o in owners if o != os.getpid() and not Path(f"/proc/{o}").exists()]
    for owner in stale:
        _remove(owner)
    return stale


@dataclass
class JobRun:
    """A main job run on a host: its exit code and output, and the network bytes all hosts had sent
    when each step's metrics row appeared (bytes per step = differences)."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    bytes_at_step: dict[int, int] = field(default_factory=dict)

    def bytes_per_step(self) -> float | None:
        steps = sorted(s for s in self.bytes_at_step if s >= 1)
        if len(steps) < 2:
            return None
        return (self.bytes_at_step[steps[-1]] - self.bytes_at_step[steps[0]]) / (steps[-1] - steps[0])


class NetnsHosts:
    def __init__(self, n: int, *, cpus: float | list[float] = 2, subnet: int | None = None,
                 shm_bytes: int = 2 << 30, env: dict[str, str] | None = None):
        if n < 1:
            raise ValueError(f"at least one host, got {n}")
        self.n = n
        self.cpus = list(cpus) if isinstance(cpus, (list, tuple)) else [cpus] * n
        if len(self.cpus) != n:
            raise ValueError(f"cpus lists {len(self.cpus)} hosts for {n}")
        self.subnet = subnet if subnet is not None else 1 + os.getpid() % 250
        self.stem = f"{PREFIX}{os.getpid()}"
        self.shm_bytes = shm_bytes
        # every process of the cluster (nodes and drivers) authenticates with this cluster's own token
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_USAGE_STATS_ENABLED": "0",
                    **(env or {})}
        self.anchors: list[subprocess.Popen] = []
        self.tmp = Path(f"/tmp/{self.stem}")
        self._up = False

    # names and addresses
    def ns(self, i: int) -> str:
        return f"{self.stem}h{i}"

    def veth(self, i: int) -> str:
        return f"{self.stem}v{i}"

    def ip(self, i: int) -> str:
        return f"10.213.{self.subnet}.{i + 1}"

    @property
    def ray_address(self) -> str:
        return f"{self.ip(0)}:{RAY_PORT}"

    # life cycle
    def __enter__(self) -> "NetnsHosts":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> None:
        sweep_stale()
        _remove(os.getpid())  # a harness of this process that was not closed
        atexit.register(self.close)
        self._up = True
        bridge = f"{self.stem}br"
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "link", "set", bridge, "up")
        for i in range(self.n):
            ns, veth = self.ns(i), self.veth(i)
            etc = Path(ETC_NETNS) / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 h{i}\n")
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # nothing listens: lookups fail at once
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _sh("ip", "link", "set", f"{veth}p", "netns", ns)
            _sh("ip", "-n", ns, "link", "set", f"{veth}p", "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "route", "add", "default", "dev", "eth0")
            _sh("ip", "link", "set", veth, "master", bridge)
            _sh("ip", "link", "set", veth, "up")
            script = (f"mount -t tmpfs -o size={self.shm_bytes} {self.stem}shm /dev/shm && hostname h{i} "
                      "&& echo ready && exec sleep infinity")
            anchor = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--propagation",
                                       "private", "--", "sh", "-c", script], stdout=subprocess.PIPE, text=True)
            if anchor.stdout.readline().strip() != "ready":
                raise RuntimeError(f"host h{i}: could not mount its /dev/shm or set its hostname")
            self.anchors.append(anchor)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        _remove(os.getpid())
        for anchor in self.anchors:
            try:
                anchor.wait(timeout=10)
            except subprocess.TimeoutExpired:
                anchor.kill()
        self.anchors = []
        shutil.rmtree(self.tmp, ignore_errors=True)
        atexit.unregister(self.close)

    # running things on a host
    def enter(self, i: int) -> list[str]:
        """The argv prefix that runs a command on host i."""
        return ["nsenter", "-t", str(self.anchors[i].pid), "--net", "--mount", "--uts", "--"]

    def popen(self, i: int, argv: list[str], *, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.enter(i) + list(argv), env={**os.environ, **self.env, **(env or {})}, **kwargs)

    def run(self, i: int, argv: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.enter(i) + list(argv), env={**os.environ, **self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"h{i}: {' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-5000:]}")
        return proc

    def limit_egress(self, i: int, mbit: float | None) -> None:
        """Cap what host i sends to `mbit` megabits per second (a token bucket on its eth0, as a NIC's
        line rate caps a machine's outgoing traffic; what it receives is capped by the senders' caps);
        None lifts the cap."""
        tc = ["ip", "netns", "exec", self.ns(i), "tc", "qdisc"]
        if mbit is None:
            _sh(*tc, "del", "dev", "eth0", "root", check=False)
        else:
            _sh(*tc, "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb", "latency", "100ms")

    def private_mount(self, i: int, path: str | os.PathLike) -> None:
        """Host i sees an empty directory at `path` instead of the shared one (storage it cannot see)."""
        os.makedirs(path, exist_ok=True)
        self.run(i, ["mount", "-t", "tmpfs", "-o", "size=64m", f"{self.stem}private", str(path)], check=True)

    # Ray
    def _ray(self, i: int, args: list[str]) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        self.run(i, [ray, "start", f"--node-ip-address={self.ip(i)}", f"--num-cpus={self.cpus[i]:g}",
                     "--num-gpus=0", f"--temp-dir={self.tmp / f'ray-h{i}'}", "--disable-usage-stats", *args],
                 timeout=180, check=True)

    def start_node(self, i: int) -> None:
        if i == 0:
            self._ray(0, ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"])
        else:
            self._ray(i, [f"--address={self.ray_address}"])

    def start_ray(self, *, timeout_s: float = 120.0) -> None:
        """A head in h0 and a worker node in every other host; returns once all have joined."""
        self.start_node(0)
        for i in range(1, self.n):
            self.start_node(i)
        self.wait_nodes(self.n, timeout_s=timeout_s)

    def alive_nodes(self) -> list[str]:
        """Node IPs the head counts alive (asked from inside h0)."""
        code = ("import json, ray; ray.init(address=%r, log_to_driver=False, logging_level='ERROR'); "
                "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
                % self.ray_address)
        proc = self.run(0, [sys.executable, "-c", code], timeout=60, check=True)
        import json

        return json.loads(proc.stdout.strip().splitlines()[-1])

    def wait_nodes(self, count: int, *, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.alive_nodes()
            if len(alive) == count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(alive)} Ray nodes alive ({alive}), waited {timeout_s:.0f}s for {count}")
            time.sleep(1.0)

    def kill_node(self, i: int) -> None:
        """Host i's machine is lost: SIGKILL its raylet, its Ray workers and anything else it runs."""
        _kill_all(self.ns(i), spare=self.anchors[i].pid)

    # traffic
    def bytes_sent(self) -> list[int]:
        """Bytes each host has sent onto the network so far (the bridge side of its veth receives them)."""
        return [int(Path(f"/sys/class/net/{self.veth(i)}/statistics/rx_bytes").read_text()) for i in range(self.n)]

    def run_job(self, config: str, overrides: list[str], *, run_dir: str | os.PathLike, host: int = 0,
                timeout: float = 900.0, env: dict[str, str] | None = None, poll_s: float = 0.1) -> JobRun:
        """`python -m rlframe.main --config-name config overrides` on `host` against this cluster, its run
        directory `run_dir` (trainer.output_dir/trainer.experiment of the overrides), watched for
        metrics rows to take the network byte counters at each step."""
        import json

        metrics = Path(run_dir) / "metrics.jsonl"
        argv = [sys.executable, "-m", "rlframe.main", "--config-name", config, f"ray.address={self.ray_address}",
                *overrides]
        out, err = (open(self.tmp / f"job-{time.monotonic_ns()}.{k}", "w+") for k in ("out", "err"))
        t0 = time.monotonic()
        proc = self.popen(host, argv, env=env, stdout=out, stderr=err, text=True)
        at_step: dict[int, int] = {}
        seen = 0
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout:
                    proc.kill()
                    break
                lines = metrics.read_text().splitlines() if metrics.exists() else []
                if len(lines) > seen:
                    sent = sum(self.bytes_sent())
                    for line in lines[seen:]:
                        if line.strip().endswith("}"):
                            at_step[json.loads(line)["step"]] = sent
                            seen += 1
                time.sleep(poll_s)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
        with out, err:
            out.seek(0)
            err.seek(0)
            return JobRun(proc.returncode, out.read(), err.read(), time.monotonic() - t0, at_step)
