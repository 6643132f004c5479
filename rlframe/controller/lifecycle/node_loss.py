"""A lost node: which one, and where the run goes on (restart.py calls this between attempts).

    dead = dead_ranks(trainer.roles)           # (group, roles, rank, node id) of every dead process
    lost = lost_nodes(dead)                    # the nodes among theirs that went down: address, ranks
    cfg = room_after_loss(cfg, lost)           # the cluster can place the run again: go on with cfg
                                               # elastic: the largest smaller dp that is valid and fits
                                               # else wait up to resources.node_wait_s, then NodeLost

A node is lost when its raylet dies (the machine went down, its network, an OOM-killed raylet): Ray
marks it dead after its health checks fail, and every actor on it with it. Each pool of the run is
placed as per-node groups on distinct nodes (config/resources.node_groups, the resource pool), so
after a loss the run either finds room for all its pools on the nodes alive (the cluster had a
spare, or the node came back), or shrinks, or ends with a message that says what it waited for and
how to go on.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from rlframe.config.schema import RunConfig
from rlframe.utils.console import say


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


def _here() -> bool:
    return True


def nodes_answer(node_ids, *, timeout_s: float = 120.0) -> dict[str, bool]:
    """Whether each node still runs work: a task pinned to it finishes (True), or Ray marks the node
    dead first (False). A node that went down may count alive for a while (until its health checks
    fail), so its liveness is asked, not read; a node that does neither within `timeout_s` counts up."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_ids = list(dict.fromkeys(node_ids))
    if not node_ids:
        return {}
    table = node_table()
    verdict = {n: False for n in node_ids if not table.get(n, {}).get("alive", False)}
    here = ray.remote(num_cpus=0, max_retries=0)(_here)
    probes = {here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(): n
              for n in node_ids if n not in verdict}
    deadline = time.monotonic() + timeout_s
    while probes and time.monotonic() < deadline:
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=1.0)
        for ref in ready:
            try:
                ray.get(ref)
                verdict[probes.pop(ref)] = True
            except Exception:  # noqa: BLE001 - the node died under the probe
                verdict[probes.pop(ref)] = False
        table = node_table()
        for ref, node in list(probes.items()):
            if not table.get(node, {}).get("alive", False):
                verdict[probes.pop(ref)] = False
    for ref, node in probes.items():
        ray.cancel(ref, force=True)
        verdict[node] = True
    return verdict


def lost_nodes(dead: list[tuple[str, list[str], int, str | None]]) -> list[LostNode]:
    """The nodes of the dead ranks that went down with them (a rank killed on a live node is not a lost node)."""
    table = node_table()
    up = nodes_answer(n for *_, n in dead if n in table)
    lost: dict[str, LostNode] = {}
    for group, _, rank, node in dead:
        if up.get(node) is False:
            lost.setdefault(node, LostNode(node, table[node]["address"], [])).ranks.append((group, rank))
    return list(lost.values())


def pool_groups(cfg: RunConfig) -> dict[str, list[int]]:
    """The per-node groups (process counts) of every pool the run places."""
    from rlframe.config.resources import node_groups, pool_sizes

    return {name: node_groups(cfg, procs) for name, procs in pool_sizes(cfg).items()}


def _slots(resources: dict[str, float], cfg: RunConfig) -> int:
    """How many of the run's processes a node of `resources` holds."""
    res = cfg.resources
    slots = int(resources.get("CPU", 0.0) // res.cpus_per_proc)  # cpus_per_proc > 0 (config/ranges.py)
    if res.use_gpu:
        slots = min(slots, int(resources.get("GPU", 0.0)))
    return slots


def alive_slots(cfg: RunConfig) -> dict[str, int]:
    """Ray node id -> processes of the run it holds, for every alive node that holds at least one."""
    slots = {node: _slots(n["resources"], cfg) for node, n in node_table().items() if n["alive"]}
    return {node: count for node, count in slots.items() if count > 0}


def fits(cfg: RunConfig, slots: dict[str, int] | None = None) -> bool:
    """Whether every pool's per-node groups can be placed on the alive nodes, the groups of one pool
    on distinct nodes (largest groups first, each on the node with the most room left)."""
    free = dict(alive_slots(cfg) if slots is None else slots)
    groups = sorted(((size, pool) for pool, sizes in pool_groups(cfg).items() for size in sizes), reverse=True)
    used: dict[str, set[str]] = {}
    for size, pool in groups:
        candidates = [n for n, room in free.items() if room >= size and n not in used.setdefault(pool, set())]
        if not candidates:
            return False
        node = max(candidates, key=lambda n: free[n])
        free[node] -= size
        used[pool].add(node)
    return True


def shrunk(cfg: RunConfig, nodes: int) -> RunConfig | None:
    """`cfg` on `nodes` nodes with the data-parallel sizes scaled down alike (colocated runs); None when
    that layout is not valid (batch sizes that do not divide, tp x pp that does not fit)."""
    from rlframe.config.validate import ConfigError, validate

    res = cfg.resources
    if res.placement != "colocated" or nodes < 1 or nodes >= res.nodes:
        return None
    roles = ["actor"] + (["critic"] if cfg.uses_critic else [])
    if any((getattr(cfg, role).dp * nodes) % res.nodes for role in roles):
        return None
    scaled = {role: dataclasses.replace(getattr(cfg, role), dp=getattr(cfg, role).dp * nodes // res.nodes)
              for role in roles}
    try:
        return validate(dataclasses.replace(cfg, resources=dataclasses.replace(res, nodes=nodes), **scaled))
    except ConfigError:
        return None


def largest_shrink(cfg: RunConfig, slots: dict[str, int]) -> RunConfig | None:
    """The valid layout on the most nodes (fewer than the run's) that fits `slots`, or None."""
    for nodes in range(min(len(slots), cfg.resources.nodes - 1), 0, -1):
        smaller = shrunk(cfg, nodes)
        if smaller is not None and fits(smaller, slots):
            return smaller
    return None


def _needs(cfg: RunConfig) -> str:
    res = cfg.resources
    each = f"{res.cpus_per_proc:g} CPU" + (" and 1 GPU" if res.use_gpu else "")
    return (f"room for its pools' per-node groups {pool_groups(cfg)} (processes of {each}; a pool's groups on "
            "distinct nodes)")


def _have(cfg: RunConfig) -> str:
    table = node_table()
    return ", ".join(sorted(f"{table[node]['address']}: {count}" for node, count in alive_slots(cfg).items())) or "none"


def room_after_loss(cfg: RunConfig, lost: list[LostNode], *, poll_s: float = 2.0) -> RunConfig:
    """The config the next attempt runs with once the cluster can hold it (see the module docstring)."""
    if not lost or fits(cfg):
        return cfg
    what = "; ".join(map(str, lost))
    if cfg.resources.elastic:
        smaller = largest_shrink(cfg, alive_slots(cfg))
        if smaller is not None:
            say(f"lost {what}; resources.elastic=true: going on with {smaller.resources.nodes} node(s) instead of "
                f"{cfg.resources.nodes} (actor dp {cfg.actor.dp} -> {smaller.actor.dp}"
                + (f", critic dp {cfg.critic.dp} -> {smaller.critic.dp}" if cfg.uses_critic else "")
                + "); the global batch is unchanged")
            return smaller
        say(f"lost {what}; resources.elastic=true, but no smaller valid layout fits the nodes left: waiting")
    wait_s = cfg.resources.node_wait_s
    say(f"lost {what}; the run needs {_needs(cfg)}, the nodes alive hold (processes) {_have(cfg)}: waiting up to "
        f"{wait_s:.0f}s (resources.node_wait_s) for nodes to join")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if fits(cfg):
            say(f"the cluster has room for the run again ({_have(cfg)})")
            return cfg
    raise NodeLost(
        f"lost {what}, and within {wait_s:.0f}s (resources.node_wait_s) the cluster did not get back {_needs(cfg)}; "
        f"the nodes alive hold (processes) {_have(cfg)}. Nothing written is lost: bring the node back (or add one) and "
        "launch the same command again (trainer.resume=auto continues from the newest checkpoint), or set "
        "resources.elastic=true to go on with fewer nodes")
