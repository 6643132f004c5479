"""Actor workers that fail on purpose, for the fault tests (loaded by `actor.worker_cls`)."""

import os
import signal
from pathlib import Path

from rlframe.single_controller import Dispatch, register
from rlframe.workers.actor import ActorWorker
from rlframe.protocol.step import step_settings


class NonFiniteLossActor(ActorWorker):
    """Every policy loss is NaN, so every gradient is non-finite."""

    def run_epochs(self, data, loss_fn, **kwargs):
        def nan_loss(outputs, mb):
            loss, metrics = loss_fn(outputs, mb)
            return loss * float("nan"), metrics

        return super().run_epochs(data, nan_loss, **kwargs)


class KilledOnceActor(ActorWorker):
    """Rank 1 SIGKILLs its own process in the middle of step KILL_STEP's actor update, once per run
    directory (a marker file there remembers; the run directory is learnt from checkpoint paths,
    `<run_dir>/checkpoints/<step>/actor`, which every save and resume passes)."""

    KILL_STEP = 3

    def _remember_run_dir(self, path: str) -> None:
        self._run_dir = Path(path).parents[2]

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self._remember_run_dir(path)
        super().save_checkpoint(path)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self._remember_run_dir(path)
        super().load_checkpoint(path)

    def run_epochs(self, data, loss_fn, **kwargs):  # inside update_actor, mid-step
        run_dir = getattr(self, "_run_dir", None)
        if run_dir is not None and self.rank == 1 and step_settings(data).global_step == self.KILL_STEP:
            marker = run_dir / "killed-once"
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return super().run_epochs(data, loss_fn, **kwargs)


class AlwaysKilledActor(ActorWorker):
    """Rank 1 SIGKILLs its own process at the start of every actor update."""

    def run_epochs(self, data, loss_fn, **kwargs):
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().run_epochs(data, loss_fn, **kwargs)


class NodeLostOnceActor(KilledOnceActor):
    """The ranks on hosts other than the head's (`h0`, where the driver runs) stop in the middle of
    step KILL_STEP's actor update, once per run directory: one writes its host name to
    `<run_dir>/node-lost-once` and all wait there for the test to take that whole node down
    (tests/controller/test_multihost.py kills the host's raylet and every process on it)."""

    HEAD_HOST = "h0"

    def run_epochs(self, data, loss_fn, **kwargs):
        import socket
        import time

        run_dir = getattr(self, "_run_dir", None)
        if (run_dir is not None and socket.gethostname() != self.HEAD_HOST
                and step_settings(data).global_step == self.KILL_STEP):
            marker = run_dir / "node-lost-once"
            if not marker.exists():
                marker.write_text(socket.gethostname())
                time.sleep(300)  # the node goes down meanwhile
        return ActorWorker.run_epochs(self, data, loss_fn, **kwargs)
