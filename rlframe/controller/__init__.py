"""Driver side of rlframe: worker groups, dispatch, resource pools, trainers."""

from rlframe.controller.decorator import register
from rlframe.controller.dispatch import Dispatch
from rlframe.controller.mesh import Mesh
from rlframe.controller.resource_pool import ResourcePool
from rlframe.controller.worker import Worker
from rlframe.controller.worker_group import (
    GroupFuture,
    RayWorkerGroup,
    RoleSpec,
    WorkerCallError,
    WorkerDiedError,
    WorkerGroupError,
    WorkerTimeoutError,
)

__all__ = [
    "Dispatch", "GroupFuture", "Mesh", "RayWorkerGroup", "ResourcePool", "RoleSpec", "Worker",
    "WorkerCallError", "WorkerDiedError", "WorkerGroupError", "WorkerTimeoutError", "register",
]
