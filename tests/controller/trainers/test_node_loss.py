"""The layout a run shrinks to after losing nodes (resources.elastic); the end-to-end loss of a host
is tests/controller/test_multihost.py."""

import pytest

from rlframe.config import load_config, validate
from rlframe.controller.trainers.node_loss import nodes_needed, shrunk

CLUSTER = ["ray.address=10.0.0.1:6379", "resources.elastic=true"]  # a joined cluster: nodes > 1 is allowed


def config(*overrides):
    return validate(load_config("ppo_tiny", CLUSTER + list(overrides)))


def test_a_colocated_run_shrinks_its_data_parallel_size_with_its_nodes():
    cfg = config("resources.nodes=4", "resources.procs_per_node=2", "actor.dp=8", "critic.dp=8",
                 "data.train_batch_size=96", "actor.mini_batch_size=96", "critic.mini_batch_size=96",
                 "actor.micro_batch_size=4", "critic.micro_batch_size=4")
    assert nodes_needed(cfg) == (4, {"CPU": 2.0})
    for nodes, dp in ((3, 6), (2, 4), (1, 2)):
        smaller = shrunk(cfg, nodes)
        assert (smaller.resources.nodes, smaller.actor.dp, smaller.critic.dp) == (nodes, dp, dp)
        assert smaller.data.train_batch_size == 96 and smaller.trainer.resume == cfg.trainer.resume


def test_no_shrink_where_the_smaller_layout_is_invalid_or_not_smaller():
    cfg = config("resources.nodes=2", "resources.procs_per_node=2", "actor.dp=2", "actor.tp=2", "critic.dp=2",
                 "critic.tp=2", "rollout.tp=2")
    assert shrunk(cfg, 1) is not None and shrunk(cfg, 1).actor.dp == 1
    odd = config("resources.nodes=2", "resources.procs_per_node=3", "actor.dp=6", "critic.dp=6",
                 "data.train_batch_size=96", "actor.mini_batch_size=96", "critic.mini_batch_size=96",
                 "actor.micro_batch_size=16", "critic.micro_batch_size=16")
    assert shrunk(odd, 1).actor.dp == 3
    assert shrunk(cfg, 2) is None and shrunk(cfg, 0) is None
    # 3 of 4 nodes would leave dp 6 of a batch of 16: not a divisor, so the run waits instead
    uneven = config("resources.nodes=4", "resources.procs_per_node=2", "actor.dp=8", "critic.dp=8",
                    "data.train_batch_size=16", "actor.mini_batch_size=16", "critic.mini_batch_size=16",
                    "actor.micro_batch_size=2", "critic.micro_batch_size=2")
    assert shrunk(uneven, 3) is None and shrunk(uneven, 2).actor.dp == 4


@pytest.mark.parametrize("override", ["resources.placement=split", "trainer.max_restarts=0"])
def test_elastic_is_refused_where_it_cannot_act(override):
    from rlframe.config import ConfigError

    extra = ["actor.dp=1", "critic.dp=1", "+resources.split_procs={actor: 1}"] if "split" in override else []
    with pytest.raises(ConfigError, match="resources.elastic=true"):
        config(override, *extra)


def test_a_lost_node_that_does_not_come_back_ends_the_run_with_what_it_waited_for(ray_cluster):
    """On this one-node Ray, a run of 2 nodes never has room again: after node_wait_s the driver
    gives up with a line naming the lost node, what the layout needs, and how to go on."""
    import time

    from rlframe.controller.trainers.node_loss import LostNode, NodeLost, room_after_loss

    cfg = config("resources.nodes=2", "resources.procs_per_node=2", "actor.dp=4", "critic.dp=4", "resources.node_wait_s=1",
                 "resources.elastic=false")
    lost = [LostNode("f" * 56, "10.213.9.2", [("hybrid", 2), ("hybrid", 3)])]
    t0 = time.monotonic()
    with pytest.raises(NodeLost) as err:
        room_after_loss(cfg, lost, poll_s=0.2)
    assert time.monotonic() - t0 < 10
    text = str(err.value)
    assert "lost node 10.213.9.2 (Ray node ffffffffffff; hybrid rank 2, hybrid rank 3)" in text, text
    assert "within 1s (resources.node_wait_s)" in text and "2 node(s) with {'CPU': 2.0} each" in text, text
    assert "trainer.resume=auto" in text and "resources.elastic=true" in text
    assert room_after_loss(cfg, []) is cfg  # nothing lost: nothing to wait for
