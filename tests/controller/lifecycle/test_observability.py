"""What opens around a run (controller/lifecycle/observability.py): a taken /metrics port stops it
before anything starts, with the config error's exit path; the trace gets its closing bracket and
the port is freed however the run ends."""

import json
import socket

import pytest

from rlframe.config import ConfigError, load_config
from rlframe.controller.lifecycle.observability import observed
from rlframe.utils import metrics_endpoint, trace


def _cfg(*overrides):
    return load_config("ppo_tiny", list(overrides))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_taken_port_is_a_config_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"trainer.prometheus_port={port}: the /metrics endpoint cannot listen"):
            with observed(_cfg(f"trainer.prometheus_port={port}", "trainer.trace=true"), tmp_path):
                pytest.fail("the run must not start")
    assert not (tmp_path / "trace.json").exists()


def test_closed_when_the_run_fails(tmp_path):
    port = _free_port()
    with pytest.raises(RuntimeError, match="a step failed"):
        with observed(_cfg(f"trainer.prometheus_port={port}", "trainer.trace=true"), tmp_path):
            assert trace.current() is not None
            with trace.span("step"):
                pass
            raise RuntimeError("a step failed")
    assert trace.current() is None and metrics_endpoint.port_problem("127.0.0.1", port) is None
    names = [e["name"] for e in json.load(open(tmp_path / "trace.json")) if e["ph"] == "X"]
    assert names == ["step", "run"]


def test_off_by_default(tmp_path):
    with observed(_cfg(), tmp_path):
        assert trace.current() is None and metrics_endpoint._endpoint is None
    assert list(tmp_path.iterdir()) == []
