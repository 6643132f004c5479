"""A worker group spanning two simulated Ray nodes (ray.cluster_utils.Cluster), in a subprocess
so that its private Ray instance does not collide with the test session's."""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import ray
    from ray.cluster_utils import Cluster
    from rlframe.controller import RayWorkerGroup, ResourcePool
    from tests.controller.workers_for_tests import EchoWorker

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": %(repo)r}})
    pool = ResourcePool(procs_per_node=[2, 2], name="two-nodes")
    group = RayWorkerGroup(pool, EchoWorker, name="spanning", timeout=180)
    ids = group.node_id()
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2], ids
    assert set(ids) == {n.node_id for n in nodes}, (ids, [n.node_id for n in nodes])
    assert group.all_reduce_rank() == [10.0] * 4
    group.shutdown()
    ray.shutdown()
    cluster.shutdown()
    print("MULTINODE-OK")
    """
) % {"repo": REPO}


def test_group_spans_two_nodes():
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0 and "MULTINODE-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
