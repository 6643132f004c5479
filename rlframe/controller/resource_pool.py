"""ResourcePool: where a worker group's processes go (Ray placement groups, one per node).

`ResourcePool(procs_per_node=[4, 4])` reserves 8 bundles: 4 packed on one node and 4 on another
(STRICT_PACK per node, so a node's ranks share fast local links). Rank r of a group on the pool
goes to bundle r in node-major order. Several worker groups can share a pool only through
colocation (one process hosting several roles); separate pools give split placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ResourcePool:
    procs_per_node: list[int]
    use_gpu: bool = False
    cpus_per_proc: float = 1.0
    name: str = "pool"
    _pgs: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.procs_per_node or any(n < 1 for n in self.procs_per_node):
            raise ValueError(
                f"resource pool {self.name!r}: procs_per_node must list at least one positive count "
                f"per node, got {self.procs_per_node}"
            )

    @property
    def world_size(self) -> int:
        return sum(self.procs_per_node)

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_proc, **({"GPU": 1.0} if self.use_gpu else {})}

    def placement_groups(self, *, timeout_s: float = 60.0) -> list:
        """Create (once) and wait for the per-node placement groups; errors say what is missing."""
        if self._pgs:
            return self._pgs
        import ray
        from ray.util.placement_group import placement_group

        pgs = [
            placement_group([self.bundle()] * n, strategy="STRICT_PACK", name=f"{self.name}-node{i}")
            for i, n in enumerate(self.procs_per_node)
        ]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
        if len(ready) < len(pgs):
            for pg in pgs:
                ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"resource pool {self.name!r} needs {len(pgs)} node(s) with bundles of {self.bundle()} "
                f"x {self.procs_per_node}, but the cluster could not place them within {timeout_s:.0f}s; "
                f"cluster resources: {ray.cluster_resources()}. Use fewer processes per node, "
                "smaller cpus_per_proc, or add nodes"
            )
        self._pgs = pgs
        return pgs

    def slots(self) -> list[tuple[object, int]]:
        """(placement group, bundle index) for every rank, node-major."""
        return [(pg, i) for pg, n in zip(self.placement_groups(), self.procs_per_node) for i in range(n)]

    def release(self) -> None:
        import ray

        for pg in self._pgs:
            ray.util.remove_placement_group(pg)
        self._pgs = []
