"""A run joins a Ray cluster only when asked (ray.address / RAY_ADDRESS); otherwise it starts a
private one, also while another cluster (`ray start --head`) runs on the machine.

The other cluster is made findable exactly as `ray start --head` makes itself findable to plain
`ray.init()` (the address file in Ray's default temp dir), but under a private RAY_TMPDIR so that
no other process on this machine sees it. Everything runs in subprocesses: the test session's own
Ray (the `ray_cluster` fixture) is not touched.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from rlframe.jobs.cluster import start_local_cluster

REPO = Path(__file__).resolve().parents[2]
HEAD_CPUS = 3

SCRIPT = textwrap.dedent("""
    import sys
    import ray
    from ray._private.services import get_ray_address_from_environment
    from rlframe.single_controller.ray_utils import init_local_ray

    head = sys.argv[1]
    # Precondition: plain ray.init() would join the running cluster (and then refuse num_cpus).
    assert get_ray_address_from_environment(None, None) == head

    init_local_ray(num_cpus=16)  # not asked to join: a private Ray
    assert ray.get_runtime_context().gcs_address != head
    assert ray.cluster_resources()["CPU"] == 16
    ray.shutdown()

    init_local_ray(address=head)  # asked: join it
    assert ray.get_runtime_context().gcs_address == head
    assert ray.cluster_resources()["CPU"] == %d
    ray.shutdown()
    print("RAY-OK")
""" % HEAD_CPUS)


@pytest.fixture(scope="module")
def head_cluster():
    tmp = tempfile.mkdtemp(prefix="rlf_rt_", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(tmp, "ray"))
    # Its own token: ~/.ray/auth_token is shared with (and rewritten by) every ray.init() on the machine.
    token = Path(tmp, "token")
    token.write_text("rlframe-ray-test-" + os.urandom(12).hex())
    cluster = start_local_cluster(num_cpus=HEAD_CPUS, temp_dir=os.path.join(tmp, "ray"),
                                  env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    address_file = Path(tmp, "ray", "ray_current_cluster")  # written once `ray start` has finished
    try:
        deadline = time.monotonic() + 120
        while not address_file.is_file():
            assert time.monotonic() < deadline and cluster.alive(), cluster.log_tail()
            time.sleep(0.5)
        yield address_file.read_text().strip(), tmp
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _env(tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    return {**env, "PYTHONPATH": str(REPO), "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(Path(tmp, "token"))}


def test_private_ray_unless_asked_to_join(head_cluster):
    head, tmp = head_cluster
    proc = subprocess.run([sys.executable, "-c", SCRIPT, head], cwd=REPO, env=_env(tmp),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "RAY-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_main_joins_when_asked_and_checks_what_the_cluster_has(head_cluster):
    """`ray.address` joins the running cluster; a run that needs more CPUs than it has fails at
    once (exit 2, no traceback) naming the key and the cluster's resources, before any worker."""
    head, tmp = head_cluster
    proc = subprocess.run([sys.executable, "-m", "rlframe.main", f"ray.address={head}",
                           "resources.cpus_per_proc=2", f"trainer.output_dir={tmp}/out"],
                          cwd=REPO, env=_env(tmp), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"the run needs 4 logical CPUs (resources.cpus_per_proc=2" in proc.stderr, proc.stderr
    assert f"the Ray cluster has {HEAD_CPUS}" in proc.stderr, proc.stderr
