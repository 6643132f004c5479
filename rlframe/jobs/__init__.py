"""Submit the main job (`python -m rlframe.main ...`) to a Ray cluster and follow it from Python.

Dataflow: `submit()` composes and validates the config on the client (so a typo fails here, not
minutes later on the cluster), fixes the run directory to an absolute path, and hands Ray's job
server (the dashboard, `http://127.0.0.1:8265` by default) an entrypoint plus a runtime
environment. The returned `JobHandle` polls the job server for status and logs and reads the run's
`metrics.jsonl` straight from the run directory.

Assumption about files: the handle reads `<trainer.output_dir>/<trainer.experiment>/metrics.jsonl`
from the client's file system. On a local cluster the job runs on this machine, so that is the same
directory. On a remote cluster the output directory must be on storage both sides mount (NFS, a
shared volume), passed as `output_dir=`; otherwise `metrics()` stays empty while status and logs work.

Modules: `client` (submit, attach, JobHandle), `auth` (the token, found in the environment or
~/.ray/auth_token), `cluster` (a local head node for notebooks and tests).

Example:
    >>> from rlframe import jobs
    >>> h = jobs.submit("grpo_tiny", overrides=["trainer.total_steps=2"], address="http://127.0.0.1:8265")
    >>> h.wait()                                   # "SUCCEEDED", or JobFailedError with the log tail
    >>> steps, reward = h.metric("critic/score/mean")
"""

from rlframe.jobs.client import (
    TERMINAL_STATES,
    ClusterNotFoundError,
    JobFailedError,
    JobHandle,
    attach,
    connect,
    read_metrics,
    submit,
    submit_command,
)
from rlframe.jobs.cluster import LocalCluster, start_local_cluster

__all__ = ["submit", "submit_command", "attach", "connect", "read_metrics", "JobHandle", "ClusterNotFoundError",
           "JobFailedError", "LocalCluster", "start_local_cluster", "TERMINAL_STATES"]
