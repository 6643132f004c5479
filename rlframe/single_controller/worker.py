"""Process side of the single controller: the `Worker` base class of every role.

A worker group runs one process per rank (a Ray actor, `rlframe.single_controller.host.WorkerHost`).
The host joins the group's torch.distributed process group once, then builds one object per role
placed in it (several roles share a process when colocated, as in the hybrid engine). Each role
object is a `Worker`: it knows its rank, the world size and its mesh, and exposes methods marked
with `@register`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlframe.single_controller.decorator import register
from rlframe.single_controller.dispatch import Dispatch, RankInfo
from rlframe.single_controller.mesh import Mesh

DEFAULT_MESH = "default"


@dataclass(frozen=True)
class WorkerContext:
    group: str  # the worker group's name
    role: str
    rank: int
    world_size: int
    local_rank: int
    backend: str  # "gloo" or "nccl"


class Worker:
    """Base class of a role. Subclasses define `__init__` freely and register methods.

    `self.rank`, `self.world_size`, `self.role` are valid inside `__init__`. The default mesh is
    pure data parallelism (`dp = world_size`); call `self.set_mesh(Mesh.of(...))` in `__init__` to
    declare tensor/pipeline dims so DP_COMPUTE splits batches by the real dp size.
    """

    _ctx: WorkerContext
    _meshes: dict[str, Mesh] | None = None

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def role(self) -> str:
        return self._ctx.role

    @property
    def mesh(self) -> Mesh:
        return self.get_mesh(DEFAULT_MESH)

    def get_mesh(self, name: str = DEFAULT_MESH) -> Mesh:
        meshes = self._meshes or {}
        if name in meshes:
            return meshes[name]
        if name == DEFAULT_MESH:
            return Mesh.of(dp=self.world_size)
        raise ValueError(f"{type(self).__name__} declares no mesh named {name!r} (it has {sorted(meshes)}); "
                         f"call self.set_mesh(..., name={name!r}) in __init__")

    def set_mesh(self, mesh: Mesh, *, name: str = DEFAULT_MESH) -> None:
        """Declare a mesh; methods registered with `mesh=name` are dispatched over it.

        A role can have several (e.g. the actor's training layout and its rollout layout)."""
        mesh.check_world_size(self.world_size)
        self._meshes = {**(self._meshes or {}), name: mesh}

    def rank_infos(self) -> dict[str, RankInfo]:
        names = set(self._meshes or {}) | {DEFAULT_MESH}
        return {n: self.rank_info(n) for n in names}

    def rank_info(self, mesh_name: str = DEFAULT_MESH) -> RankInfo:
        """This rank's place for dispatch: its dp coordinate and whether its output is collected.

        One rank per dp group is collected: tp (and cp/ep) coordinate 0 on the last pp stage,
        which is where a pipeline's outputs live.
        """
        mesh = self.get_mesh(mesh_name)
        coords = mesh.coords(self.rank)
        collect = all(
            c == (mesh.size(n) - 1 if n == "pp" else 0) for n, c in coords.items() if n != "dp"
        )
        return RankInfo(rank=self.rank, dp_rank=coords.get("dp", 0), dp_size=mesh.size("dp"), collect=collect)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def peak_memory(self) -> dict[str, float]:
        """This rank's process: its peak resident memory (`rss_mb`, shared by the roles it hosts) and,
        for a role with a training engine, its model's parameters, gradient buffers and optimizer state
        (rlframe/utils/memory.py), in MB."""
        from rlframe.utils.memory import peak_rss_mb, state_mb

        out = {"rss_mb": peak_rss_mb()}
        engine = getattr(self, "engine", None)
        if engine is not None and hasattr(engine, "model"):
            frozen = getattr(getattr(engine, "config", None), "frozen", False)  # a reference: nothing to train
            try:
                out.update(state_mb(engine.model, None if frozen else getattr(engine, "optimizer", None)))
            except Exception as err:  # a metric never stops a run: say what could not be counted, once
                if not getattr(self, "_state_mb_failed", False):
                    self._state_mb_failed = True
                    print(f"[rlframe] {self.role} rank {self.rank}: model state not counted "
                          f"({type(err).__name__}: {err}); memory/*_mb/{self.role} left out", flush=True)
        return out


def build_role(cls: type, ctx: WorkerContext, args: tuple, kwargs: dict) -> Worker:
    """Instantiate a role with its context set before its `__init__` runs."""
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"role {ctx.role!r}: {cls!r} is not a subclass of rlframe.single_controller.Worker")
    obj = cls.__new__(cls)
    obj._ctx = ctx
    obj.__init__(*args, **kwargs)
    return obj
