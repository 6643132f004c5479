"""What a run shows of itself while it runs, opened around it by `run_training` (docs/observability.md):
its timeline (trainer.trace: rlframe/utils/trace.py) and its Prometheus endpoint
(trainer.prometheus_port: rlframe/utils/metrics_endpoint.py). Both stay open across restarts of the
worker groups and close when the run ends, however it ends: the trace file gets its closing bracket,
the endpoint's port is freed."""

from __future__ import annotations

import errno
from contextlib import contextmanager
from pathlib import Path

from rlframe.config.schema import RunConfig
from rlframe.utils.console import say
from rlframe.controller.lifecycle.tracking import RunFilesWriteFailed
from rlframe.utils import metrics_endpoint, trace


@contextmanager
def observed(cfg: RunConfig, run_dir: Path):
    t = cfg.trainer
    if t.prometheus_port > 0:
        from rlframe.config import ConfigError

        try:  # before Ray and the workers: a port taken since the config was validated ends the run here
            endpoint = metrics_endpoint.start(host=t.prometheus_host, port=t.prometheus_port, run=t.experiment)
        except metrics_endpoint.EndpointUnavailable as err:
            raise ConfigError([str(err)]) from None
        say(f"metrics for Prometheus: {endpoint.url}")
    try:
        if t.trace:
            recorder = trace.open_trace(run_dir)
            say(f"timeline of the run: {recorder.path} (open it in https://ui.perfetto.dev)")
        ended = False
        try:
            yield
            ended = True
        finally:
            _close_trace(ended=ended)
    finally:
        metrics_endpoint.stop()


def _close_trace(*, ended: bool) -> None:
    """The trace's last events and closing bracket; a full disk is reported like the run's other files
    (when the run ended otherwise, with one line: the error that ended it is the one to see)."""
    recorder = trace.current()
    try:
        trace.close_trace()
    except OSError as err:
        if ended and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RunFilesWriteFailed(
                f"the run's trace could not be finished in {recorder.path}: the disk is full ({err.strerror}); "
                "the events written before are readable (Perfetto reads a trace without its closing bracket)") from None
        if ended:
            raise
        say(f"the trace {recorder.path} could not be finished ({err}); its events so far are readable")
