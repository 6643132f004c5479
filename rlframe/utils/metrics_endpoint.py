"""An optional Prometheus endpoint on the driver (trainer.prometheus_port > 0): GET /metrics gives
the numeric metrics of the latest logged step as gauges, named `rlframe_` + the metric's name with
every character outside [a-zA-Z0-9_] made `_` (`critic/score/mean` -> `rlframe_critic_score_mean`),
each with the label run="<trainer.experiment>", plus `rlframe_step` (the step) and
`rlframe_step_logged_unix` (when it was logged: a run whose value stops moving is stuck).

    endpoint = start(host="127.0.0.1", port=9464, run="ppo_tiny")   # EndpointUnavailable if taken
    publish({"step": 3, "critic/score/mean": 0.4})                   # Tracker.log, each step
    stop()                                                           # the run ends

The server is prometheus_client's, on a daemon thread of the driver; a scrape reads a copy of the
latest row, so the training loop never waits for it.
"""

from __future__ import annotations

import re
import socket
import threading
import time

PREFIX = "rlframe_"
HELP = {"step": "the step of the latest metrics", "step_logged_unix": "when the latest step was logged (unix seconds)"}
_endpoint: "MetricsEndpoint | None" = None


class EndpointUnavailable(RuntimeError):
    """The endpoint's address cannot be bound (the port is taken, the host is not this machine's)."""


def gauge_name(metric: str) -> str:
    return PREFIX + re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9_]", "_", metric)).strip("_")


def _free_port(host: str) -> int | None:
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    except OSError:
        return None


def _family(host: str) -> int:
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]


def port_problem(host: str, port: int) -> str | None:
    """Why the endpoint could not listen on host:port now (None: it can), said as a config problem.
    None also when this driver serves it already (a layout validated again during the run: the
    smaller layout after a lost node, controller/lifecycle/node_loss.py)."""
    if _endpoint is not None and (_endpoint.host, _endpoint.port) == (host, port):
        return None
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            s.bind((host, port))
        return None
    except OSError as err:
        return _unavailable(host, port, err)


def _unavailable(host: str, port: int, err: OSError) -> str:
    import errno

    if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
        return (f"trainer.prometheus_host={host!r} is not an address of this machine ({err.strerror or err}); "
                "the /metrics endpoint listens on the driver: use 127.0.0.1 (this machine only) or 0.0.0.0 (all "
                "interfaces)")
    free = _free_port(host)
    why = "another process listens there (another run, an exporter)" if err.errno == errno.EADDRINUSE else \
        f"{err.strerror or err}"
    return (f"trainer.prometheus_port={port}: the /metrics endpoint cannot listen on {host}:{port}: {why}; "
            f"pick a free port{f', e.g. trainer.prometheus_port={free}' if free else ''}, or 0 for no endpoint")


class MetricsEndpoint:
    """The server and the latest row; also the registry's collector (`collect`)."""

    def __init__(self, *, host: str, port: int, run: str):
        from prometheus_client import CollectorRegistry, start_http_server

        self.run = run
        self._lock = threading.Lock()
        self._row: dict[str, float] = {}
        self._logged = 0.0
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        except OSError as err:
            raise EndpointUnavailable(_unavailable(host, port, err)) from None
        self.host, self.port = host, self.server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def publish(self, row: dict) -> None:
        numbers = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        with self._lock:  # an evaluation's val/ metrics stay until the next one, steps without one between
            kept = {k: v for k, v in self._row.items() if k.startswith("val/") and k not in numbers}
            self._row, self._logged = {**kept, **numbers}, time.time()

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            row, logged = dict(self._row), self._logged
        if not row:
            return
        seen = set()
        for key, value in [*row.items(), ("step_logged_unix", logged)]:
            name = gauge_name(key)
            if name in seen:  # two metrics that differ only in punctuation: the first is kept
                continue
            seen.add(name)
            family = GaugeMetricFamily(name, HELP.get(key, f"{key} (latest step)"), labels=["run"])
            family.add_metric([self.run], value)
            yield family

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start(*, host: str, port: int, run: str) -> MetricsEndpoint:
    """Serve /metrics on host:port (port 0: any free one, see `.port`); EndpointUnavailable when it
    cannot be bound."""
    global _endpoint
    if _endpoint is not None:
        raise RuntimeError(f"a metrics endpoint is serving already ({_endpoint.url}); stop it first")
    _endpoint = MetricsEndpoint(host=host, port=port, run=run)
    return _endpoint


def publish(row: dict) -> None:
    """The latest logged step's metrics (a no-op without an endpoint)."""
    if _endpoint is not None:
        _endpoint.publish(row)


def stop() -> None:
    global _endpoint
    endpoint, _endpoint = _endpoint, None
    if endpoint is not None:
        endpoint.stop()
