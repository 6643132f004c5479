"""The actor's generate step brings vLLM's memory back in the order a GPU needs: weights, then the
weight sync into them, then the KV cache, then generation, then sleep. On GPU `sleep(level=1)`
offloads the weights, so a sync before waking them is lost (overwritten by the stale copy on wake)
or faults; here a recording engine with the same sleep bookkeeping checks the order on CPU."""

from contextlib import contextmanager

import pytest
import torch

from rlframe.protocol import DataProto
from rlframe.resharding.executor import ReshardStats
from rlframe.workers import actor as actor_module
from rlframe.workers.actor import ActorWorker
from rlframe.workers.rollout.base import MEMORY_TAGS, RolloutEngine
from rlframe.workers.rollout.weight_sync import WeightSyncStats


class RecordingEngine(RolloutEngine):
    """Frees weights and KV cache in `sleep` like vLLM on GPU, and logs every memory event."""

    backend = "recording"

    def __init__(self):
        self.log: list[str] = []

    def _release(self):
        self.log.append("sleep")
        return MEMORY_TAGS

    def _reacquire(self, tags):
        self.log.append("wake " + "+".join(tags))

    @contextmanager
    def weight_update(self):
        self.require_awake(("weights",), doing="a weight update")
        self.log.append("write weights")
        yield lambda pieces: None

    @property
    def last_sync_stats(self):
        return WeightSyncStats()

    def generate(self, prompts, sampling):
        self.require_awake(("weights", "kv_cache"), doing="generate()")
        self.log.append("generate")
        return DataProto.from_dict(tensors={"responses": torch.zeros(len(prompts), 1, dtype=torch.long)})


class NoShards:
    def local_shards(self):
        return {}


def _actor(engine) -> ActorWorker:
    actor = ActorWorker.__new__(ActorWorker)  # no training engine or process group: only the generate step
    actor.rollout, actor.engine, actor._plan, actor.bucket_bytes = engine, NoShards(), None, 1 << 20
    actor._weights_stale, actor.lora = True, False  # full-weight sync (LoRA syncs adapters the same way)
    return actor


def test_generate_wakes_weights_syncs_then_wakes_the_kv_cache(monkeypatch):
    def execute_plan(plan, *, local, consumer, bucket_bytes):
        consumer([])
        return ReshardStats(rank=0)

    monkeypatch.setattr(actor_module, "execute_plan", execute_plan)
    engine = RecordingEngine()
    actor = _actor(engine)
    engine.sleep()  # training ran: the engine sleeps
    prompts = DataProto.from_dict(tensors={"input_ids": torch.ones(2, 3, dtype=torch.long)},
                                  meta_info={"sampling": {"n": 1, "max_new_tokens": 1}})
    actor.generate_sequences(prompts)
    assert engine.log == ["sleep", "wake weights", "write weights", "wake kv_cache", "generate", "sleep"]
    # without an update in between there is nothing to write: weights and cache wake, in that order
    engine.log.clear()
    actor.generate_sequences(prompts)
    assert engine.log == ["wake weights", "wake kv_cache", "generate", "sleep"]


def test_a_weight_write_or_generate_while_asleep_is_refused():
    engine = RecordingEngine()
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"a weight update while the rollout engine's \['weights'\] sleep"):
        with engine.weight_update():
            pass
    engine.wake(("weights",))
    with pytest.raises(RuntimeError, match=r"generate\(\) while the rollout engine's \['kv_cache'\] sleep"):
        engine.generate(DataProto.from_dict(tensors={"x": torch.zeros(1)}), None)
    with pytest.raises(ValueError, match="wake tags \\['scheduling'\\] unknown"):
        engine.wake(("scheduling",))
