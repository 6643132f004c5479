"""The driver's /metrics endpoint (rlframe/utils/metrics_endpoint.py): scraped over HTTP it gives the
latest published step as gauges with the run's label; a taken port is a clear error; stopped, the
port is free again."""

import socket
import urllib.error
import urllib.request

import pytest

from rlframe.utils import metrics_endpoint


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value of every sample line."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


@pytest.fixture()
def endpoint():
    ep = metrics_endpoint.start(host="127.0.0.1", port=0, run="exp1")  # any free port
    yield ep
    metrics_endpoint.stop()


def test_latest_step_as_gauges(endpoint):
    assert endpoint.url.startswith("http://127.0.0.1:")
    assert scrape(endpoint.url) == {}  # nothing logged yet
    metrics_endpoint.publish({"step": 1, "critic/score/mean": 0.25, "val/pass@4": 0.5, "note": "text"})
    metrics_endpoint.publish({"step": 2, "critic/score/mean": 0.75, "timing_s/gen": 1.5})
    got = scrape(endpoint.url)
    assert got['rlframe_step{run="exp1"}'] == 2.0
    assert got['rlframe_critic_score_mean{run="exp1"}'] == 0.75
    assert got['rlframe_timing_s_gen{run="exp1"}'] == 1.5
    assert 'rlframe_timing_s_gen{run="exp1"}' in got and 'rlframe_note{run="exp1"}' not in got
    assert got['rlframe_val_pass_4{run="exp1"}'] == 0.5  # an evaluation's metrics stay until the next one
    assert got['rlframe_step_logged_unix{run="exp1"}'] > 1.7e9
    metrics_endpoint.publish({"step": 3, "critic/score/mean": 0.5})
    got = scrape(endpoint.url)
    assert 'rlframe_timing_s_gen{run="exp1"}' not in got  # other metrics: the latest step's only
    # the driver validates a layout again during the run (a lost node): its own port is no problem
    assert metrics_endpoint.port_problem("127.0.0.1", endpoint.port) is None


def test_gauge_names():
    assert metrics_endpoint.gauge_name("critic/score/mean") == "rlframe_critic_score_mean"
    assert metrics_endpoint.gauge_name("val/pass@4") == "rlframe_val_pass_4"
    assert metrics_endpoint.gauge_name("timing_s/startup/python, imports") == "rlframe_timing_s_startup_python_imports"


def test_port_in_use_is_a_clear_error_and_stop_frees_the_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        problem = metrics_endpoint.port_problem("127.0.0.1", port)
        assert f"trainer.prometheus_port={port}" in problem and "pick a free port" in problem
        with pytest.raises(metrics_endpoint.EndpointUnavailable, match=f"trainer.prometheus_port={port}: .*listens"):
            metrics_endpoint.start(host="127.0.0.1", port=port, run="exp1")
    assert metrics_endpoint.port_problem("127.0.0.1", port) is None
    ep = metrics_endpoint.start(host="127.0.0.1", port=port, run="exp1")
    metrics_endpoint.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(ep.url, timeout=2)
    assert metrics_endpoint.port_problem("127.0.0.1", port) is None
    metrics_endpoint.publish({"step": 3})  # no endpoint: nothing to do


def test_a_host_of_another_machine_is_named():
    problem = metrics_endpoint.port_problem("192.0.2.1", 9464)  # TEST-NET-1: never this machine's
    assert "trainer.prometheus_host='192.0.2.1' is not an address of this machine" in problem
