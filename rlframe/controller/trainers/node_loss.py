"""A lost node: which one, and where the run goes on (restart.py calls this between attempts).

    dead = dead_ranks(trainer.roles)           # (group, roles, rank, node id) of every dead process
    lost = lost_nodes(dead)                    # the nodes among theirs that Ray counts dead: address, ranks
    cfg = room_after_loss(cfg, lost)           # the cluster fits the layout again: go on with cfg
                                               # elastic: a smaller dp that fits the nodes that remain
                                               # else wait up to resources.node_wait_s, then NodeLost

A node is lost when its raylet dies (the machine went down, its network, an OOM-killed raylet): Ray
marks it dead after its health checks fail, and every actor on it with it. Each attempt's layout
needs `resources.nodes` distinct nodes with room for `resources.procs_per_node` processes (the
resource pool places each node's group on a node of its own), so after a loss the run either finds
enough nodes alive (the cluster had a spare, or the node came back) or shrinks, or ends with a
message that says what it waited for and how to go on.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from rlframe.config.schema import RunConfig
from rlframe.controller.trainers.tracking import say


class NodeLost(RuntimeError):
    """A node was lost and the cluster did not get room for the run's layout back in time."""


@dataclass
class LostNode:
    node_id: str
    address: str
    ranks: list[tuple[str, int]]  # (group, rank) of the run's processes it hosted

    def __str__(self) -> str:
        ranks = ", ".join(f"{g} rank {r}" for g, r in self.ranks)
        return f"node {self.address} (Ray node {self.node_id[:12]}; {ranks})"


def node_table() -> dict[str, dict]:
    """Ray node id -> {address, alive, resources} of every node the cluster knows (dead ones too)."""
    import ray

    return {n["NodeID"]: {"address": n["NodeManagerAddress"], "alive": bool(n["Alive"]),
                          "resources": dict(n.get("Resources") or {})} for n in ray.nodes()}


def node_answers(node_id: str, *, timeout_s: float = 120.0) -> bool:
    """Whether node `node_id` still runs work: a task pinned to it finishes (True), or Ray marks the
    node dead first (False). A dead rank's node may still count alive for a while after it went down
    (until its health checks fail), so its liveness is asked, not read."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(_here).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _ = ray.wait([probe], timeout=1.0)
        if ready:
            try:
                ray.get(probe)
                return True
            except Exception:  # noqa: BLE001 - the node died under the probe
                return False
        if not node_table().get(node_id, {}).get("alive", False):
            return False
    ray.cancel(probe, force=True)
    return True  # neither answered nor declared dead: treat as alive (the restart then goes as for a killed rank)


def _here() -> bool:
    return True


def lost_nodes(dead: list[tuple[str, list[str], int, str | None]]) -> list[LostNode]:
    """The nodes of the dead ranks that went down with them (a rank killed on a live node is not a lost node)."""
    table = node_table()
    down = {node: not (table[node]["alive"] and node_answers(node))
            for node in dict.fromkeys(n for *_, n in dead if n in table)}
    lost: dict[str, LostNode] = {}
    for group, _, rank, node in dead:
        if down.get(node):
            lost.setdefault(node, LostNode(node, table[node]["address"], [])).ranks.append((group, rank))
    return list(lost.values())


def nodes_needed(cfg: RunConfig) -> tuple[int, dict[str, float]]:
    """(distinct nodes, resources each must have) for the run's largest pool."""
    from rlframe.config.resources import pool_sizes

    res = cfg.resources
    per_node = {"CPU": res.procs_per_node * res.cpus_per_proc, **({"GPU": float(res.procs_per_node)} if res.use_gpu else {})}
    largest = max(pool_sizes(cfg).values())
    return -(-largest // res.procs_per_node), per_node


def nodes_with_room(per_node: dict[str, float]) -> list[str]:
    """Addresses of the alive nodes whose resources hold one node's share of the run."""
    return sorted(n["address"] for n in node_table().values()
                  if n["alive"] and all(n["resources"].get(k, 0.0) >= v for k, v in per_node.items()))


def fits(cfg: RunConfig) -> bool:
    import ray

    from rlframe.config.resources import check_joined_cluster

    count, per_node = nodes_needed(cfg)
    return len(nodes_with_room(per_node)) >= count and not check_joined_cluster(cfg, ray.cluster_resources())


def shrunk(cfg: RunConfig, nodes: int) -> RunConfig | None:
    """`cfg` on `nodes` nodes with the data-parallel sizes scaled down alike (colocated runs); None when
    that layout is not valid (batch sizes that do not divide, tp x pp that does not fit)."""
    from rlframe.config.validate import ConfigError, validate

    res = cfg.resources
    if res.placement != "colocated" or nodes < 1 or nodes >= res.nodes:
        return None
    scale = (nodes, res.nodes)
    if any((role.dp * scale[0]) % scale[1] for role in (cfg.actor, cfg.critic)):
        return None
    smaller = dataclasses.replace(
        cfg, resources=dataclasses.replace(res, nodes=nodes),
        actor=dataclasses.replace(cfg.actor, dp=cfg.actor.dp * scale[0] // scale[1]),
        critic=dataclasses.replace(cfg.critic, dp=cfg.critic.dp * scale[0] // scale[1]))
    try:
        return validate(smaller)
    except ConfigError:
        return None


def room_after_loss(cfg: RunConfig, lost: list[LostNode], *, poll_s: float = 2.0) -> RunConfig:
    """The config the next attempt runs with once the cluster can hold it (see the module docstring)."""
    if not lost or fits(cfg):
        return cfg
    count, per_node = nodes_needed(cfg)
    what = "; ".join(map(str, lost))
    if cfg.resources.elastic:
        remaining = len(nodes_with_room(per_node))
        smaller = shrunk(cfg, remaining)
        if smaller is not None:
            say(f"lost {what}; resources.elastic=true: going on with {remaining} node(s) instead of "
                f"{cfg.resources.nodes} (actor dp {cfg.actor.dp} -> {smaller.actor.dp}, critic dp {cfg.critic.dp} -> "
                f"{smaller.critic.dp}); the global batch is unchanged")
            return smaller
        say(f"lost {what}; resources.elastic=true, but no smaller layout on {remaining} node(s) is valid: waiting")
    wait_s = cfg.resources.node_wait_s
    say(f"lost {what}; the run needs {count} node(s) with {per_node} each, {len(nodes_with_room(per_node))} are "
        f"alive with room: waiting up to {wait_s:.0f}s (resources.node_wait_s) for nodes to join")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if fits(cfg):
            say(f"the cluster has room for the run again ({', '.join(nodes_with_room(per_node))})")
            return cfg
    raise NodeLost(
        f"lost {what}, and within {wait_s:.0f}s (resources.node_wait_s) the cluster did not get back {count} node(s) "
        f"with {per_node} each (alive with room: {nodes_with_room(per_node) or 'none'}). Nothing written is lost: "
        "bring the node back (or add one) and launch the same command again (trainer.resume=auto continues from "
        "the newest checkpoint), or set resources.elastic=true to go on with fewer nodes")
