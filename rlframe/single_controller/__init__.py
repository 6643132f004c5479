"""The single-controller runtime: one driver calls SPMD worker groups on Ray (imports no trainer).

- worker.py: `Worker`, the base of a role's class, and the context a rank runs in.
- decorator.py, dispatch.py: `@register(dispatch=...)` and the table of dispatch modes (how a call's
  arguments are split over ranks and its answers gathered).
- mesh.py: a worker's parallel layout (dp, tp, pp, ...), which drives dispatch.
- worker_group.py: `RayWorkerGroup`, the driver-side handle of a group: every registered method as a
  method that splits, calls all ranks and gathers; colocated roles share the processes.
- resource_pool.py: Ray placement groups of a pool's processes; host.py: the body of one rank's
  process (`WorkerHost`); compiled.py: Ray's compiled graphs for short calls; transport.py: what a
  call's payload costs; ray_utils.py: starting or joining Ray; demo.py: a tour.
"""

from rlframe.single_controller.decorator import register
from rlframe.single_controller.dispatch import Dispatch
from rlframe.single_controller.mesh import Mesh
from rlframe.single_controller.resource_pool import ResourcePool
from rlframe.single_controller.worker import Worker
from rlframe.single_controller.worker_group import (
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
