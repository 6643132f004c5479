"""The megatron engine's spec (rlframe.plugins): megatron-core tp/pp/dp with the distributed optimizer.

Imports nothing heavy: validation and the planner read it before any worker starts.
"""

from rlframe.plugins.engines import EngineSpec, register_train_engine

MODEL_TYPES = ("llama", "qwen2")  # what model.py builds (SUPPORTED_MODEL_TYPES, kept equal by a test)


def check_model(hf_config, role, *, where: str) -> None:
    """What MegatronTrainEngine would refuse: another architecture, tied embeddings, a layout that
    does not divide the model's shapes."""
    from rlframe.workers.engines.megatron.model import check_hf_config

    check_hf_config(hf_config, tp=role.tp, pp=role.pp, where=where)


def read_checkpoint(engine_dir, layout: dict, hf_config):
    from rlframe.workers.engines.megatron.export import read_model

    return read_model(engine_dir, layout, hf_config)


MEGATRON = register_train_engine(EngineSpec(
    name="megatron", target="rlframe.workers.engines.megatron.engine:MegatronTrainEngine",
    summary="megatron-core tensor, pipeline (1F1B) and data parallelism, distributed optimizer",
    parallelisms={"dp", "tp", "pp"}, sequence_parallel=True, model_types=MODEL_TYPES, tied_embeddings=False,
    process_global_state=True, distributed_optimizer=True, activations="mcore", pipeline_schedule="1F1B",
    check_model=check_model, read_checkpoint=read_checkpoint))
