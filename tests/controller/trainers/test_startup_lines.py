"""The start-up's lines say what happens: where the tiny model comes from (the shipped pre-trained copy,
an earlier build cached here, or a build now), and which hosts a run across hosts starts its workers on."""

import json

import pytest

from rlframe.config.load import load_config
from rlframe.controller.trainers.ppo import worker_groups_line
from rlframe.controller.trainers.prepare import model_line


def test_the_model_line_says_shipped_built_now_or_cached(tmp_path):
    from rlframe.data.pretrain import PRETRAIN_SEED, _recipe, cache_key

    cfg = load_config("ppo_tiny", [f"model.cache_dir={tmp_path}"])
    assert model_line(cfg) == "model: tiny preset 'demo' (shipped pre-trained)"

    other = load_config("ppo_tiny", [f"model.cache_dir={tmp_path}", "model.tiny_pretrain_steps=7"])
    assert model_line(other) == ("model: tiny preset 'demo' (built and pre-trained on the arithmetic task now, "
                                 "then cached)")
    key = cache_key(preset="demo", task="arithmetic", seed=PRETRAIN_SEED, cfg=_recipe("demo", "arithmetic", 7, None))
    (tmp_path / "models" / key).mkdir(parents=True)
    (tmp_path / "models" / key / "rlframe_pretrain.json").write_text(json.dumps({}))
    assert model_line(other) == (f"model: tiny preset 'demo' (pre-trained on the arithmetic task earlier, cached in "
                                 f"{tmp_path / 'models'})")

    assert model_line(load_config("ppo_tiny", [f"model.path={tmp_path}"])) == f"model: {tmp_path}"


def test_the_worker_groups_line_names_the_hosts_of_a_run_across_hosts():
    cfg = load_config("ppo_tiny", ["resources.nodes=2", "resources.procs_per_node=1"])
    line = worker_groups_line(cfg, ["node-a (10.0.0.1)", "node-b (10.0.0.2)"])
    assert line.startswith("starting worker groups (colocated, 2 processes on 2 hosts: node-a (10.0.0.1), "
                           "node-b (10.0.0.2)): actor "), line
    one = worker_groups_line(cfg, ["vm (10.0.0.1)", "vm (10.0.0.1)"])  # two Ray nodes of one machine
    assert one.startswith("starting worker groups (colocated, 2 processes): actor "), one


def test_the_hosts_are_the_placements_nodes_or_the_clusters(monkeypatch):
    import ray

    from rlframe.controller.lifecycle import prelaunch
    from rlframe.single_controller.resource_pool import node_hosts

    nodes = [{"NodeID": "n1", "Alive": True, "NodeManagerHostname": "node-a", "NodeManagerAddress": "10.0.0.1"},
             {"NodeID": "n2", "Alive": True, "NodeManagerHostname": "node-b", "NodeManagerAddress": "10.0.0.2"},
             {"NodeID": "n3", "Alive": False, "NodeManagerHostname": "node-c", "NodeManagerAddress": "10.0.0.3"}]
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert node_hosts() == ["node-a (10.0.0.1)", "node-b (10.0.0.2)"]  # the alive ones
    assert node_hosts(["n2", "n1"]) == ["node-b (10.0.0.2)", "node-a (10.0.0.1)"]

    class Placed:
        def node_ids(self):
            return ["n2"]

    cfg = load_config("ppo_tiny", [])
    monkeypatch.setitem(prelaunch._launched, (cfg.trainer.experiment, "hybrid"), (Placed(), None))
    assert prelaunch.run_hosts(cfg) == ["node-b (10.0.0.2)"]  # where the launched processes went
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert node_hosts() == []
