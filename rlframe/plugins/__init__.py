"""Plugins declare their traits in a spec; the rest of rlframe asks the spec, never the plugin's name.

Three kinds have spec registries here, each importable without torch (validation, the dry run and
the planner read them before any worker starts):

| kind | spec | registry | built-in specs |
|---|---|---|---|
| training engine (`actor.strategy`, `critic.strategy`) | `EngineSpec` | `TRAIN_ENGINES` | workers/engines/fsdp/spec.py, workers/engines/megatron/spec.py |
| rollout backend (`rollout.backend`) | `BackendSpec` | `ROLLOUT_BACKENDS` | workers/rollout/vllm_spec.py, workers/rollout/hf_spec.py |

Advantage estimators declare theirs where they are registered (`rlframe.algos.register_advantage_estimator`
takes the traits as keywords; rlframe.algos.registry.estimator_spec reads them back).

A new engine or backend is one file that defines the implementation and registers its spec:

    from rlframe.plugins import EngineSpec, register_train_engine
    register_train_engine(EngineSpec(name="ddp", target="examples.plugins.ddp_engine:DDPTrainEngine", parallelisms={"dp"}))

and a config line naming it (`actor.strategy=ddp`), with the module listed under `imports:` so the
driver and every worker import it (docs/architecture.md lists what each kind of plugin touches).
"""

from rlframe.plugins.backends import ROLLOUT_BACKENDS, BackendSpec, backend_spec, register_rollout_backend
from rlframe.plugins.engines import TRAIN_ENGINES, EngineSpec, engine_spec, register_train_engine
from rlframe.plugins.registry import SpecRegistry, load_target

__all__ = ["BackendSpec", "EngineSpec", "ROLLOUT_BACKENDS", "SpecRegistry", "TRAIN_ENGINES", "backend_spec",
           "engine_spec", "load_target", "register_rollout_backend", "register_train_engine"]
