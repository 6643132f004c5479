"""Where a run goes on after losing nodes: whether the cluster can place it (its pools' per-node
groups on distinct nodes), the layout it shrinks to (resources.elastic), and the failure after
resources.node_wait_s. The end-to-end loss of a host is tests/controller/test_multihost.py."""

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.lifecycle.node_loss import fits, largest_shrink, pool_groups, shrunk

CLUSTER = ["ray.address=10.0.0.1:6379", "resources.elastic=true"]  # a joined cluster: nodes > 1 is allowed
BIG = ["resources.nodes=4", "resources.procs_per_node=2", "actor.dp=8", "critic.dp=8", "data.train_batch_size=96",
       "actor.mini_batch_size=96", "critic.mini_batch_size=96", "actor.micro_batch_size=4", "critic.micro_batch_size=4"]


def config(*overrides, name="ppo_tiny"):
    return validate(load_config(name, CLUSTER + list(overrides)))


def test_a_run_fits_where_each_pool_gets_distinct_nodes_with_room():
    cfg = config(*BIG)
    assert pool_groups(cfg) == {"hybrid": [2, 2, 2, 2]}
    assert fits(cfg, {"a": 2, "b": 2, "c": 2, "d": 3})
    assert not fits(cfg, {"a": 2, "b": 2, "c": 2})          # a node short
    assert not fits(cfg, {"a": 8})                          # room enough, but one node
    assert not fits(cfg, {"a": 2, "b": 2, "c": 2, "d": 1})  # a node too small
    # split placement, a process per host: actor, critic and generation each need a node
    split = config("resources.placement=split", "actor.dp=1", "critic.dp=1", "resources.procs_per_node=1",
                   "+resources.split_procs={actor: 1, rollout: 1}", "resources.elastic=false")
    assert sorted(pool_groups(split)) == ["actor", "critic", "ref", "rollout"]
    assert fits(split, {"a": 1, "b": 1, "c": 1, "d": 1}) and fits(split, {"a": 2, "b": 2})
    assert not fits(split, {"a": 1, "b": 1, "c": 1})


def test_a_colocated_run_shrinks_its_data_parallel_size_with_its_nodes():
    cfg = config(*BIG)
    for nodes, dp in ((3, 6), (2, 4), (1, 2)):
        smaller = shrunk(cfg, nodes)
        assert (smaller.resources.nodes, smaller.actor.dp, smaller.critic.dp) == (nodes, dp, dp)
        assert smaller.data.train_batch_size == 96 and smaller.trainer.resume == cfg.trainer.resume
    assert largest_shrink(cfg, {"a": 2, "b": 2, "c": 2}).resources.nodes == 3
    assert largest_shrink(cfg, {"a": 2, "b": 1, "c": 2}).resources.nodes == 2  # b holds too few processes
    assert shrunk(cfg, 4) is None and shrunk(cfg, 0) is None


def test_the_largest_valid_smaller_layout_is_taken():
    # 3 of 4 nodes would leave dp 6 of a batch of 16: not a divisor, so 2 nodes (dp 4)
    uneven = config("resources.nodes=4", "resources.procs_per_node=2", "actor.dp=8", "critic.dp=8",
                    "data.train_batch_size=16", "actor.mini_batch_size=16", "critic.mini_batch_size=16",
                    "actor.micro_batch_size=2", "critic.micro_batch_size=2")
    assert shrunk(uneven, 3) is None
    assert largest_shrink(uneven, {"a": 2, "b": 2, "c": 2}).actor.dp == 4
    tp2 = config("resources.nodes=2", "resources.procs_per_node=2", "actor.dp=2", "actor.tp=2", "critic.dp=2",
                 "critic.tp=2", "rollout.tp=2")
    assert shrunk(tp2, 1).actor.dp == 1
    # a run without a critic does not need the critic's (unused) dp of 2 to scale from 3 nodes to 2
    grpo = config("resources.nodes=3", "resources.procs_per_node=1", "actor.dp=3", "critic.dp=2",
                  "data.train_batch_size=6", "actor.mini_batch_size=24", "actor.micro_batch_size=4", name="grpo_tiny")
    assert not grpo.uses_critic and shrunk(grpo, 2).actor.dp == 2 and shrunk(grpo, 1).actor.dp == 1


@pytest.mark.parametrize("override", ["resources.placement=split", "trainer.max_restarts=0"])
def test_elastic_is_refused_where_it_cannot_act(override):
    from rlframe.config import ConfigError

    extra = ["actor.dp=1", "critic.dp=1", "+resources.split_procs={actor: 1}"] if "split" in override else []
    with pytest.raises(ConfigError, match="resources.elastic=true"):
        config(override, *extra)


def test_a_lost_node_that_does_not_come_back_ends_the_run_with_what_it_waited_for(ray_cluster):
    """On this one-node Ray, a run of 2 nodes never has room again: after node_wait_s the driver
    gives up with a line naming the lost node, what the layout needs, and how to go on."""
    from rlframe.controller.lifecycle.node_loss import LostNode, NodeLost, room_after_loss

    cfg = config("resources.nodes=2", "resources.procs_per_node=2", "actor.dp=4", "critic.dp=4",
                 "resources.node_wait_s=1", "resources.elastic=false")
    lost = [LostNode("f" * 56, "10.213.9.2", [("hybrid", 2), ("hybrid", 3)])]
    with pytest.raises(NodeLost) as err:  # it gives up (a hang would be the pytest timeout's)
        room_after_loss(cfg, lost, poll_s=0.2)
    text = str(err.value)
    assert "lost node 10.213.9.2 (Ray node ffffffffffff; hybrid rank 2, hybrid rank 3)" in text, text
    assert "within 1s (resources.node_wait_s)" in text and "{'hybrid': [2, 2]}" in text, text
    assert "trainer.resume=auto" in text and "resources.elastic=true" in text
    assert room_after_loss(cfg, []) is cfg  # nothing lost: nothing to wait for
