"""A GCS or client port given as the job address is named as such; start_local_cluster makes its temp_dir."""

import socket
from pathlib import Path

import pytest

from rlframe import jobs
from rlframe.jobs import client, cluster


def test_gcs_port_is_named_not_the_job_server():
    msg = client._how_to_start("http://10.255.255.1:6379")
    assert "6379 is the GCS port" in msg and "8265" in msg


def test_listening_non_job_port_is_not_called_no_cluster():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(jobs.ClusterNotFoundError, match="does not serve Ray's job API"):
            jobs.connect(f"http://127.0.0.1:{port}")


def test_missing_temp_dir_is_created(tmp_path, monkeypatch):
    started = {}

    class FakeProc:
        def __init__(self, cmd, **kw):
            started["cmd"] = cmd

    def ready(c, **kw):
        started["ready"] = True

    monkeypatch.setattr(cluster.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(cluster, "_wait_ready", ready)
    target = tmp_path / "not" / "yet"
    c = cluster.start_local_cluster(temp_dir=str(target))
    assert target.is_dir() and (target / "ray_start.log").is_file() and started["ready"]
    assert f"--temp-dir={target}" in started["cmd"] and c._owns_temp_dir is False
