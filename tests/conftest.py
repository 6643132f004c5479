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
def worker_zygote(tmp_path_factory):
    """The socket of a server that forks Ray worker processes with their modules already imported
    (tests/zygote.py): pass `zygote.client_command(sock)` as a Ray's py_executable, or
    `zygote.job_env(sock)` to a driver launched as a subprocess."""
    import subprocess
    import sys
    import time

    sock = str(tmp_path_factory.mktemp("zygote") / "sock")
    server = subprocess.Popen([sys.executable, "-m", "tests.zygote", "serve", sock], cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": REPO_ROOT, "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.monotonic() + 300
    while not os.path.exists(sock):
        assert server.poll() is None and time.monotonic() < deadline, "the worker zygote did not start"
        time.sleep(0.1)
    yield sock
    server.kill()
    server.wait()


@pytest.fixture(scope="session")
def ray_cluster(worker_zygote):
    """A local Ray instance shared by the tests of one session (starting Ray costs about 5 s), whose
    worker processes fork from the session's zygote."""
    from rlframe.single_controller.ray_utils import init_local_ray
    from tests import zygote

    import ray

    init_local_ray(runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT, "TOKENIZERS_PARALLELISM": "false"},
                                "py_executable": zygote.client_command(worker_zygote)})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def zygote_for_subprocess_runs(worker_zygote):
    """Module-wide: runs the module's tests launch as subprocesses (`python -m rlframe.main`) start
    their Ray's workers through the session's zygote too (an autouse fixture of such modules uses it)."""
    from tests import zygote

    with pytest.MonkeyPatch.context() as mp:
        for key, value in zygote.job_env(worker_zygote).items():
            mp.setenv(key, value)
        yield



def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _refuse_unlisted_or_ci_skip(report) -> None:
    """A skip tests/skips.py does not list, or one CI must not have under CI=true, becomes a failure."""
    from tests.skips import refusal

    if not report.skipped or hasattr(report, "wasxfail"):
        return
    why = refusal(_skip_reason(report), ci=os.environ.get("CI", "").lower() == "true")
    if why is not None:
        report.outcome, report.longrepr = "failed", why


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _refuse_unlisted_or_ci_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _refuse_unlisted_or_ci_skip(outcome.get_result())


@pytest.fixture(autouse=True)
def _plugins_a_test_registers_do_not_outlive_it():
    """Registries are process-wide: an estimator, engine, backend or algorithm a test registers (its plugin
    module imported by `imports:` or directly) is removed after it, and its module forgotten so that the
    next test importing it registers it again; later tests see the built-ins only, whatever ran before."""
    import sys

    from rlframe.algos import registry as algos
    from rlframe.config.algorithms import ALGORITHMS
    from rlframe.plugins import ROLLOUT_BACKENDS, TRAIN_ENGINES

    specs = [TRAIN_ENGINES, ROLLOUT_BACKENDS]
    functions = [algos.ADVANTAGE_ESTIMATORS, algos.POLICY_LOSSES, algos.KL_ESTIMATORS, algos.LOSS_AGG_MODES]
    for registry in specs + functions:
        registry._load_builtins()
    before = ({id(r): dict(r._specs) for r in specs}, {id(r): (dict(r._table), dict(r._traits)) for r in functions},
              dict(ALGORITHMS), set(sys.modules))
    yield
    spec_tables, function_tables, algorithms, modules = before
    changed = any(r._specs != spec_tables[id(r)] for r in specs) or dict(ALGORITHMS) != algorithms or any(
        r._table != function_tables[id(r)][0] for r in functions)
    if not changed:
        return
    for r in specs:
        r._specs = dict(spec_tables[id(r)])
    for r in functions:
        r._table, r._traits = (dict(t) for t in function_tables[id(r)])
    ALGORITHMS.clear()
    ALGORITHMS.update(algorithms)
    for name in set(sys.modules) - modules:
        if name.startswith(("examples.", "tests.")):
            del sys.modules[name]
