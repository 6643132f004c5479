"""ResourcePool: where a worker group's processes go (Ray placement groups, one per node).

`ResourcePool(procs_per_node=[4, 4])` reserves 8 bundles: 4 packed on one node and 4 on another
(STRICT_PACK per node, so a node's ranks share fast local links). The per-node groups of one pool
go to distinct Ray nodes: each is placed in turn with a label selector that excludes the nodes the
earlier ones took (on a node with room for both, two STRICT_PACK groups would otherwise share it,
and "dp across 2 nodes" would silently run on one). Rank r of a group on the pool goes to bundle r
in node-major order; `node_ids()` says where each node's group went. Several worker groups can
share a pool only through colocation (one process hosting several roles); separate pools give split
placement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries its id as this label


@dataclass
class ResourcePool:
    procs_per_node: list[int]
    use_gpu: bool = False
    cpus_per_proc: float = 1.0
    name: str = "pool"
    _pgs: list = field(default_factory=list, repr=False)
    _nodes: list = field(default_factory=list, repr=False)

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
        from ray.util.placement_group import placement_group, placement_group_table

        pgs, nodes = [], []
        deadline = time.monotonic() + timeout_s
        for i, n in enumerate(self.procs_per_node):
            # a one-node pool goes wherever it fits; the groups of a multi-node pool each to a node of its own
            avoid = [{NODE_ID_LABEL: f"!in({','.join(nodes)})"}] * n if nodes else None
            pg = placement_group([self.bundle()] * n, strategy="STRICT_PACK", name=f"{self.name}-node{i}",
                                 bundle_label_selector=avoid)
            pgs.append(pg)
            ready, _ = ray.wait([pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for made in pgs:
                    ray.util.remove_placement_group(made)
                alive = sum(1 for node in ray.nodes() if node["Alive"])
                raise RuntimeError(
                    f"resource pool {self.name!r} needs {len(self.procs_per_node)} distinct node(s) with bundles of "
                    f"{self.bundle()} x {self.procs_per_node}, but the cluster could place only {i} of them within "
                    f"{timeout_s:.0f}s; it has {alive} node(s) alive, resources {ray.cluster_resources()}. Use fewer "
                    "processes per node, smaller cpus_per_proc, or add nodes")
            nodes.append(placement_group_table(pg)["bundles_to_node_id"][0])
        self._pgs, self._nodes = pgs, nodes
        return pgs

    def node_ids(self) -> list[str]:
        """The Ray node id of each node's group, in pool order (empty while the pool is not placed)."""
        return list(self._nodes)

    def slots(self) -> list[tuple[object, int]]:
        """(placement group, bundle index) for every rank, node-major."""
        return [(pg, i) for pg, n in zip(self.placement_groups(), self.procs_per_node) for i in range(n)]

    def release(self) -> None:
        import ray

        for pg in self._pgs:
            ray.util.remove_placement_group(pg)
        self._pgs, self._nodes = [], []


def node_hosts(node_ids: list[str] | None = None) -> list[str]:
    """"hostname (ip)" of each Ray node in `node_ids` (in order; ids the cluster does not know are
    left out), or of every alive node of the cluster when none are given; none while Ray is not started."""
    import ray

    if not ray.is_initialized():
        return []
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    chosen = [nodes[i] for i in node_ids if i in nodes] if node_ids else [n for n in nodes.values() if n.get("Alive")]
    return [f"{n.get('NodeManagerHostname') or '?'} ({n.get('NodeManagerAddress') or '?'})" for n in chosen]
