"""The fsdp engine's spec (rlframe.plugins): FSDP2 + DTensor tensor parallelism + Ulysses, on CPU or GPU.

Imports nothing heavy: validation and the planner read it before any worker starts.
"""

from rlframe.plugins.engines import EngineSpec, register_train_engine

# The projections its tensor-parallel plan knows (engines/lora.py SUPPORTED_TARGETS, kept equal by a test)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj")


def check_model(hf_config, role, *, where: str) -> None:
    """What FSDPTrainEngine would refuse: shapes tp (and Ulysses' tp x sp) does not split."""
    from rlframe.workers.engines.fsdp.parallelize import check_model_fits

    check_model_fits(hf_config, tp=role.tp, sp=role.sp, model_type_path=where)


def read_checkpoint(engine_dir, layout: dict, hf_config):
    from rlframe.workers.engines.fsdp.export import read_model

    return read_model(engine_dir)


FSDP = register_train_engine(EngineSpec(
    name="fsdp", target="rlframe.workers.engines.fsdp.engine:FSDPTrainEngine",
    summary="FSDP2 + DTensor tensor parallelism (+ Ulysses sequence parallelism)",
    parallelisms={"dp", "tp", "sp"}, lora_targets=LORA_TARGETS,
    weights_sharded_over_dp=True, fp32_params=True, gathers_layers=True, activations="transformers",
    check_model=check_model, read_checkpoint=read_checkpoint))
