"""The fsdp training engine (FSDP2 + tensor parallelism over one DeviceMesh) and its parts:
engine.py (FSDPTrainEngine), parallelize.py (TP plans and FSDP wrapping), modeling.py (loading
and saving HF models), shards.py (local shards for resharding), vocab_parallel.py (log-probs over
a vocabulary split across tp ranks; megatron uses it too)."""
