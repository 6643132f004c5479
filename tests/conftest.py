"""Shared fixtures: one local Ray cluster per test session, skips for GPU-only tests."""

import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray instance shared by the tests of one session (starting Ray costs about 5 s), whose
    worker processes fork from one that has imported their modules once (tests/zygote.py)."""
    import subprocess
    import sys
    import time

    from rlframe.controller.ray_utils import init_local_ray
    from tests import zygote

    import ray

    sock = str(tmp_path_factory.mktemp("zygote") / "sock")
    init_local_ray(runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT, "TOKENIZERS_PARALLELISM": "false"},
                                "py_executable": zygote.client_command(sock)})
    # started after Ray, so that it reads the session's auth token (ray.init writes it) when it needs it
    server = subprocess.Popen([sys.executable, "-m", "tests.zygote", "serve", sock], cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": REPO_ROOT, "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.monotonic() + 120
    while not os.path.exists(sock):
        assert server.poll() is None and time.monotonic() < deadline, "the worker zygote did not start"
        time.sleep(0.1)
    yield ray
    ray.shutdown()
    server.kill()
