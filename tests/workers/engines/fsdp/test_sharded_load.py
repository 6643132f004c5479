"""The fsdp engine builds its model on the meta device and fills only each rank's shards from the
checkpoint (fsdp/sharded_load.py); activation checkpointing recomputes each decoder layer in the backward.

On 2 gloo ranks: every local shard, right after start-up, equals bit for bit the same slice of the
model a full `from_pretrained` load gives (with LoRA: adapters injected into that full model with
the same seed), for dp2 and tp2, the LM head and the critic's value head (drawn from the seed), a
tied-embedding model stored in bf16; the rotary buffers equal the full model's. One training step
with activation checkpointing gives the loss, gradient norm and new weights of the same step without.
"""

from __future__ import annotations

import pytest
import torch

from rlframe.utils.spawn import run_distributed
from tests.workers.engines.reference import (
    build_reference, dp_slice, engine_on_mesh, make_batch, policy_loss, value_loss,
)

LORA = dict(lora_rank=4, lora_alpha=8.0)
# (model, head, dp, tp, engine overrides)
LOADS = [("qwen2", "lm", 2, 1, {}), ("qwen2", "lm", 1, 2, {}), ("qwen2", "value", 2, 1, {}),
         ("qwen2", "value", 1, 2, LORA), ("qwen2", "lm", 2, 1, LORA), ("tied_bf16", "lm", 2, 1, {})]
STEPS = [("lm", 2, 1, {}), ("value", 1, 2, LORA)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlframe.data.tiny_model import build_random_model
    from rlframe.data.tokenizer import save_char_tokenizer

    root = tmp_path_factory.mktemp("sharded_load")
    tied = root / "tied_bf16"
    tok = save_char_tokenizer(tied)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(2)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tied))
    return {"qwen2": str(build_random_model(root / "qwen2", preset="test", seed=0)), "tied_bf16": str(tied)}


def _full_load(path, head, lora):
    """Today's reference: the whole model from from_pretrained in fp32, adapters injected into it."""
    model = build_reference(path, head=head)
    if lora:
        from rlframe.workers.engines.lora import LoraSettings, inject_lora
        from rlframe.workers.engines.value_head import VALUE_HEAD

        inject_lora(model, LoraSettings(rank=lora["lora_rank"], alpha=lora["lora_alpha"]), seed=0,
                    trainable_prefixes=tuple(VALUE_HEAD) if head == "value" else ())
    return dict(model.named_parameters()), dict(model.named_buffers())


def _load_mismatches(engine, params, buffers) -> list[str]:
    from rlframe.workers.engines.fsdp.shards import local_shards

    bad = []
    shards = local_shards(engine.model)  # base weights and adapters
    if shards.keys() != params.keys():
        bad.append(f"names differ: {sorted(set(shards) ^ set(params))}")
    for name, (shape, box, local) in shards.items():
        full = params[name].detach()
        if local.dtype != torch.float32 or shape != tuple(full.shape) or not torch.equal(local, full[box.slices()]):
            bad.append(name)
    for name, b in engine.model.named_buffers():
        if not torch.equal(b, buffers[name]):
            bad.append(f"buffer {name}")
    return bad


def _step(path, head, dp, tp, world, batch, **overrides):
    engine = engine_on_mesh(path, dp=dp, tp=tp, world=world, head=head, lr=1e-3, eps=1e-6, **overrides)
    mine, _ = dp_slice(batch, engine)
    calls = []  # forwards of a layer's MLP: once per micro-batch, twice with recomputation
    engine.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    if head == "lm":
        metrics = engine.train_step(policy_loss, mine, with_entropy=True)
    else:
        metrics = engine.train_step(value_loss, mine)
    return {**metrics, "mlp_forwards": len(calls)}, engine.full_state_dict()


def _run(rank, world, paths):
    out = {"load": {}, "checkpointing": {}}
    for model, head, dp, tp, extra in LOADS:
        engine = engine_on_mesh(paths[model], dp=dp, tp=tp, world=world, head=head, **extra)
        out["load"][f"{model}/{head}/dp{dp}tp{tp}/lora{bool(extra)}"] = _load_mismatches(
            engine, *_full_load(paths[model], head, extra))
    batch = make_batch()
    for head, dp, tp, extra in STEPS:
        off, w_off = _step(paths["qwen2"], head, dp, tp, world, batch, **extra)
        on, w_on = _step(paths["qwen2"], head, dp, tp, world, batch, activation_checkpointing=True, **extra)
        out["checkpointing"][f"{head}/dp{dp}tp{tp}/lora{bool(extra)}"] = {
            "forwards": (off["mlp_forwards"], on["mlp_forwards"]), "loss": abs(on["loss"] - off["loss"]), "grad_norm": abs(on["grad_norm"] - off["grad_norm"]),
            "weights": max(float((w_on[k] - w_off[k]).abs().max()) for k in w_off), "changed": float(
                max((w_off[k] - _step_start(paths["qwen2"], head, extra)[k]).abs().max() for k in w_off))}
    return out


_starts: dict = {}


def _step_start(path, head, lora):
    """The full model before the step (to see that the step moved it)."""
    key = (path, head, bool(lora))
    if key not in _starts:
        params, _ = _full_load(path, head, lora)
        _starts[key] = {k: v.detach() for k, v in params.items()}
    return _starts[key]


@pytest.fixture(scope="module")
def spawned(models):
    return run_distributed(_run, world_size=2, args=(models,), timeout_s=240)


def test_shards_equal_a_full_load_bit_for_bit(spawned):
    for rank, res in enumerate(spawned):
        assert len(res["load"]) == len(LOADS)
        bad = {case: names for case, names in res["load"].items() if names}
        assert not bad, f"rank {rank}: shards differing from a full load: {bad}"


def test_activation_checkpointing_gives_the_same_step(spawned):
    for rank, res in enumerate(spawned):
        for case, diff in res["checkpointing"].items():
            assert diff["changed"] > 1e-4, (rank, case, diff)  # the step did train
            off, on = diff["forwards"]
            assert off >= 1 and on == 2 * off, (rank, case, diff)  # the backward recomputed each layer
            assert diff["loss"] <= 1e-6 and diff["grad_norm"] <= 1e-6 and diff["weights"] <= 1e-6, (rank, case, diff)
