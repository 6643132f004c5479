"""The actor's generate step brings vLLM's memory back in the order a GPU needs: weights, then the
weight sync into them, then the KV cache, then generation, then sleep. On GPU `sleep(level=1)`
offloads the weights, so a sync before waking them is lost (overwritten by the stale copy on wake)
or faults; with a full-weight sync the actor lets vLLM drop them instead (level 2) and syncs at every
wake. A recording engine with the same sleep bookkeeping checks the order on CPU."""

from contextlib import contextmanager

import pytest
import torch

from rlframe.protocol import DataProto
from rlframe.resharding.executor import ReshardStats
from rlframe.workers import actor as actor_module
from rlframe.workers.actor import ActorWorker
from rlframe.workers.rollout.base import MEMORY_TAGS, RolloutEngine
from rlframe.workers.rollout.weight_sync import WeightSyncStats
from rlframe.workers.rollout.config import SamplingConfig


class RecordingEngine(RolloutEngine):
    """Frees weights and KV cache in `sleep` like vLLM on GPU, and logs every memory event."""

    backend = "recording"

    def __init__(self):
        self.log: list[str] = []

    def _release(self, *, full_sync_next):
        self.log.append("sleep dropping the weights" if full_sync_next else "sleep")
        if full_sync_next:  # as vLLM's sleep level 2
            self._weights_missing = "dropped its weights"
        return MEMORY_TAGS

    def _reacquire(self, tags):
        self.log.append("wake " + "+".join(tags))

    @contextmanager
    def weight_update(self):
        self.require_awake(("weights",), doing="a weight update")
        self.log.append("write weights")
        yield lambda pieces: None
        self._weights_missing = None

    @property
    def last_sync_stats(self):
        return WeightSyncStats()

    def generate(self, prompts, sampling):
        self.require_awake(("weights", "kv_cache"), doing="generate()")
        self.require_weights(doing="generate()")
        self.log.append("generate")
        return DataProto.from_dict(tensors={"responses": torch.zeros(len(prompts), 1, dtype=torch.long)})


class NoShards:
    def local_shards(self):
        return {}


def _actor(engine, *, stale: bool = True, lora: bool = False) -> ActorWorker:
    actor = ActorWorker.__new__(ActorWorker)  # no training engine or process group: only the generate step
    actor.rollout, actor.engine, actor._plan, actor.bucket_bytes = engine, NoShards(), None, 1 << 20
    actor._weights_stale, actor.lora, actor._delta = stale, lora, None
    return actor


PROMPTS = DataProto.from_dict(tensors={"input_ids": torch.ones(2, 3, dtype=torch.long)},
                              meta_info={"sampling": SamplingConfig(n=1, max_new_tokens=1)})


@pytest.fixture
def plan_runs(monkeypatch):
    def execute_plan(plan, *, local, consumer, bucket_bytes, delta=None):
        consumer([])
        return ReshardStats(rank=0)

    monkeypatch.setattr(actor_module, "execute_plan", execute_plan)


def test_generate_wakes_weights_syncs_then_wakes_the_kv_cache(plan_runs):
    engine = RecordingEngine()
    actor = _actor(engine)
    engine.sleep()  # training ran: the engine sleeps
    actor.generate_sequences(PROMPTS)
    # a full-weight sync rewrites every weight: the engine may drop them while training runs
    assert engine.log == ["sleep", "wake weights", "write weights", "wake kv_cache", "generate",
                          "sleep dropping the weights"]
    # dropped, they are synced again at the next generate though no update came in between
    engine.log.clear()
    actor.generate_sequences(PROMPTS)
    assert engine.log == ["wake weights", "write weights", "wake kv_cache", "generate", "sleep dropping the weights"]


def test_with_lora_the_base_weights_are_kept_and_nothing_is_written_without_an_update(plan_runs):
    engine = RecordingEngine()
    actor = _actor(engine, stale=False, lora=True)  # LoRA syncs only adapters: the base must survive the sleep
    engine.sleep()
    actor.generate_sequences(PROMPTS)
    assert engine.log == ["sleep", "wake weights", "wake kv_cache", "generate", "sleep"]


def test_an_engine_started_with_dummy_weights_is_synced_before_its_first_generation(plan_runs):
    engine = RecordingEngine()
    engine._weights_missing = "was started with dummy weights"
    actor = _actor(engine, stale=False)  # no update yet: only the dummy weights ask for the sync
    with pytest.raises(RuntimeError, match="generate\\(\\) before a weight sync: the rollout engine was started with "
                                           "dummy weights.*rollout.load_format=real"):
        engine.generate(PROMPTS, None)
    actor.generate_sequences(PROMPTS)
    assert engine.log[:3] == ["write weights", "generate", "sleep dropping the weights"]
    assert not actor._weights_stale


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
