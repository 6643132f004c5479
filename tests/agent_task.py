"""The tool task on the pre-trained agent preset, as the agent tests start from it."""

from __future__ import annotations

AGENT = ["model.tiny_preset=agent", "data.task=tool_arithmetic", "agent.enabled=true", "data.prompt_length=128",
         "data.response_length=96", "data.val_size=16"]


def agent_task():
    """(cfg, model path, tokenizer, validation dataset, agent loop) of grpo_tiny with AGENT; the model is
    pre-trained once, then cached. Close `loop.runner` when done."""
    from transformers import AutoTokenizer

    from rlframe.config import load_config
    from rlframe.controller.trainers.agent_loop import build_agent_loop
    from rlframe.controller.trainers.prepare import build_data, model_path

    cfg = load_config("grpo_tiny", AGENT)
    path = model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    _, val = build_data(cfg, tokenizer)
    return cfg, path, tokenizer, val, build_agent_loop(cfg, tokenizer)
