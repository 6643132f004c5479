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
def ray_cluster():
    """A local Ray instance shared by the tests of one session (starting Ray costs about 5 s)."""
    from rlframe.controller.ray_utils import init_local_ray

    import ray

    init_local_ray(runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT, "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
