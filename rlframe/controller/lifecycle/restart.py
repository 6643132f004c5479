"""A worker process that dies does not end the run: tear down, start again, resume.

    attempt 1: trainer = Trainer(cfg); trainer.fit()      # a rank is killed (OOM killer, SIGKILL, node loss)
               -> WorkerGroupError in the driver
               -> which host processes are dead? (none: a rank *raised*, which a restart would repeat: re-raise)
               -> report group, roles, rank; close the trainer (kills every rank, frees the placement groups)
    attempt 2: Trainer(cfg with trainer.resume = the newest complete checkpoint this run wrote)
               ... at most `trainer.max_restarts` times, then WorkerRestartsExhausted with the history.

With no checkpoint written yet, the restart begins where the first attempt began (its own
`trainer.resume`). Only this run's checkpoints count (run_identity.py), and the run directory's
lock (run_lock.py) stays held by the driver across restarts. The resumed attempt reproduces the
uninterrupted run's metrics, as a resumed process does (tests/controller/lifecycle/test_resume.py):
model, optimizer, dataloader and RNG states all come from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlframe.config.schema import RunConfig
from rlframe.controller.lifecycle.node_loss import lost_nodes, room_after_loss
from rlframe.utils.console import say


@dataclass
class WorkerFailure:
    attempt: int
    step: int
    group: str
    roles: list[str]
    rank: int
    error: str
    node: str | None = None  # the lost node it ran on, when its whole node went down

    def __str__(self) -> str:
        where = f" with its {self.node}" if self.node else ""
        return (f"attempt {self.attempt}, step {self.step}: worker group {self.group!r} (roles "
                f"{', '.join(self.roles)}) rank {self.rank} died{where} ({self.error})")


class WorkerRestartsExhausted(RuntimeError):
    """Workers kept dying: more failures than `trainer.max_restarts` allows."""


def dead_ranks(roles, *, timeout_s: float = 10.0, node_timeout_s: float = 90.0) -> list[tuple[str, list[str], int, str | None]]:
    """(group name, roles it hosts, rank, Ray node id) of every host process that is gone.

    A live rank answers `pid()` within `timeout_s`; a dead one fails the call with RayActorError.
    A rank that does neither is busy (stuck in a collective with the dead one) or on a node that
    went down and that Ray has not marked dead yet (until its health checks fail): its node is asked
    (node_loss.nodes_answer, at most `node_timeout_s`), and only a node that is down makes it dead.
    """
    import ray
    from ray.exceptions import RayActorError

    from rlframe.controller.lifecycle.node_loss import nodes_answer

    hosts: dict[int, tuple[object, list[str]]] = {}
    for role in ("actor", "critic", "ref", "reward_model", "generator"):
        group = getattr(roles, role, None)
        if group is not None:
            hosts.setdefault(id(group.hosts), (group.hosts, []))[1].append(role)
    probes = [(h.name, names, rank, node, actor.pid.remote())
              for h, names in hosts.values() for rank, (actor, node) in enumerate(zip(h.actors, h.rank_nodes()))]
    ready, pending = ray.wait([p[4] for p in probes], num_returns=len(probes), timeout=timeout_s)
    ready, pending = set(ready), set(pending)
    up = nodes_answer({p[3] for p in probes if p[4] in pending and p[3] is not None}, timeout_s=node_timeout_s)
    dead = []
    for name, names, rank, node, ref in probes:
        if ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                dead.append((name, names, rank, node))
        elif up.get(node) is False:
            dead.append((name, names, rank, node))  # on a node that is down
    return dead


def _resume_after_failure(trainer):
    """Where the next attempt continues: the checkpoint this attempt saved last (verified by the manager
    when written; after a resume from an explicit older checkpoint, the branch it continued, not a
    newer-numbered one it left), while it is still there; else None (the attempt's own trainer.resume
    stands, where this run began)."""
    saved = getattr(trainer, "saved", None)
    if saved is None or saved == getattr(trainer, "resumed_from", None) or not saved.is_dir():
        return None
    return saved


def fit_with_restarts(cfg: RunConfig, *, trainer_cls, run_dir) -> dict:
    """`trainer_cls(cfg, run_dir=run_dir).fit()`, restarted after a worker process dies."""
    from rlframe.single_controller.worker_group import WorkerGroupError

    history: list[WorkerFailure] = []
    lost = []
    while True:
        cfg = room_after_loss(cfg, lost)  # after a lost node: wait for room, or shrink (node_loss.py)
        trainer = trainer_cls(cfg, run_dir=run_dir)
        try:
            return trainer.fit()
        except WorkerGroupError as err:
            dead = dead_ranks(trainer.roles) if getattr(trainer, "roles", None) is not None else []
            if not dead:
                raise  # a rank raised (or timed out) while all are alive: restarting would repeat it
            lost = lost_nodes(dead)
            first_line = str(err).splitlines()[0]
            history += [WorkerFailure(attempt=len(history) + 1, step=getattr(trainer, "step", 0), group=g,
                                      roles=names, rank=r, error=first_line,
                                      node=next((str(n) for n in lost if n.node_id == node), None))
                        for g, names, r, node in dead[:1]]
            summary = "\n  ".join(map(str, history))
            if len(history) > cfg.trainer.max_restarts:
                raise WorkerRestartsExhausted(
                    f"worker processes died {len(history)} times, more than trainer.max_restarts="
                    f"{cfg.trainer.max_restarts} allows:\n  {summary}\nCheck the workers' logs (out of memory? "
                    "killed?); raise trainer.max_restarts to keep trying") from err
            resume = _resume_after_failure(trainer)
            if resume is not None:
                cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume=str(resume)))
            say(f"{history[-1]}; restart {len(history)} of {cfg.trainer.max_restarts}: starting the worker groups "
                f"again, resuming from {resume or 'where this run began'}")
            if getattr(trainer, "tracker", None) is not None:  # the next attempt opens its own
                trainer.tracker.close()
        finally:
            trainer.close()
