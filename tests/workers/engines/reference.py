"""Single-process references for the engine tests: plain transformers + torch.optim, no sharding.

Batches follow docs/contracts.md (left-padded prompts, right-padded responses). The reference
computes on the padded batch directly (no packing), so it also checks the engine's packing.
"""

from __future__ import annotations

import torch

PROMPT_LEN, RESPONSE_LEN = 6, 5


def make_batch(*, batch_size: int = 8, prompt_len: int = PROMPT_LEN, response_len: int = RESPONSE_LEN,
               vocab: int = 100, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch with mixed prompt and response lengths, advantages and returns."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, prompt_len + 1, (batch_size,), generator=g)
    rlen = torch.randint(1, response_len + 1, (batch_size,), generator=g)
    plen[0], rlen[0] = prompt_len, response_len  # one full-length row
    ids = torch.randint(4, vocab, (batch_size, prompt_len + response_len), generator=g)
    pmask = torch.arange(prompt_len)[None] >= (prompt_len - plen)[:, None]
    rmask = torch.arange(response_len)[None] < rlen[:, None]
    mask = torch.cat([pmask, rmask], dim=1).long()
    ids = ids * mask  # pad id 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, prompt_len:],
        "response_mask": rmask.float(),
        "advantages": torch.randn(batch_size, response_len, generator=g),
        "returns": torch.randn(batch_size, response_len, generator=g),
    }


def policy_loss(outputs, mb):
    """Token-mean policy-gradient loss with an entropy bonus (needs entropy in outputs)."""
    m = mb["response_mask"]
    pg = -(outputs["log_probs"] * mb["advantages"] * m).sum() / m.sum()
    ent = (outputs["entropy"] * m).sum() / m.sum()
    return pg - 0.01 * ent, {"entropy": ent.detach()}


def sft_loss(outputs, mb):
    """Token-mean negative log-likelihood of the responses (falls when training works)."""
    m = mb["response_mask"]
    return -(outputs["log_probs"] * m).sum() / m.sum(), {}


def value_loss(outputs, mb):
    m = mb["response_mask"]
    return 0.5 * (((outputs["values"] - mb["returns"]) ** 2) * m).sum() / m.sum(), {}


def build_reference(path: str, *, head: str, state_dict=None):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if head == "lm":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model, info = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32,
                                                                      output_loading_info=True)
        init_missing_value_head(model, missing=info["missing_keys"], seed=0)  # as the engines (seed 0)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model.config.use_cache = False
    return model


def init_missing_value_head(model, *, missing, seed: int) -> None:
    """A critic whose checkpoint has no `score` gets the value head every engine draws from `seed`."""
    from rlframe.workers.engines.value_head import VALUE_HEAD, fresh_value_head

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in fresh_value_head(model.config.hidden_size, seed=seed).items():
            if name in set(missing) & set(VALUE_HEAD):
                params[name].copy_(t)


def reference_outputs(model, batch, *, head: str, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """log_probs/entropy (B, R) or values (B, R) on the padded batch, with gradient."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    r = batch["responses"].shape[1]
    t = batch["input_ids"].shape[1]
    if head == "value":
        return {"values": out.logits.squeeze(-1)[:, t - r - 1 : t - 1]}
    logp = torch.log_softmax(out.logits[:, t - r - 1 : t - 1].float() / temperature, dim=-1)
    return {
        "log_probs": logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1),
        "entropy": -(logp.exp() * logp).sum(-1),
    }


def reference_step(model, batch, loss_fn, *, head: str, lr: float, weight_decay: float, eps: float,
                   grad_clip: float) -> dict:
    """One full-batch step: loss, grad norm, clipped AdamW (matrices decayed) -> new weights."""
    loss, _ = loss_fn(reference_outputs(model, batch, head=head), batch)
    model.zero_grad()
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params if p.grad is not None))
    if norm > grad_clip:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(grad_clip / (float(norm) + 1e-6))
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=lr, eps=eps).step()
    return {"loss": float(loss), "grad_norm": float(norm),
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    d = (a.float() - b.float()).abs()
    if mask is not None:
        d = d[mask.bool()]
    return float(d.max()) if d.numel() else 0.0


def engine_on_mesh(path, *, dp: int, tp: int, world: int, head: str = "lm", **config):
    """An fsdp engine at (dp, tp) on a ("rep", "dp", "tp") mesh over `world` ranks, so several
    layouts run side by side in one spawn (each "rep" slice its own engine)."""
    from torch.distributed.device_mesh import init_device_mesh

    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    mesh = init_device_mesh("cpu", (world // (dp * tp), dp, tp), mesh_dim_names=("rep", "dp", "tp"))
    return get_train_engine("fsdp")(TrainEngineConfig(model_path=path, head=head, dp=dp, tp=tp, **config),
                                    device_mesh=mesh["dp", "tp"])


def dp_slice(batch, engine):
    """This rank's dp share of `batch`, and the rows it covers."""
    dp, d = engine.config.dp, engine.mesh.get_local_rank("dp")
    n = next(iter(batch.values())).shape[0] // dp
    return {k: v[d * n : (d + 1) * n] for k, v in batch.items()}, slice(d * n, (d + 1) * n)


def box_errors(engine, truth: dict) -> float:
    """Each local shard equals the ground-truth slice and the box the resharding layout predicts."""
    layout = engine.resharding_layout()
    rank = engine.layout()["rank"]
    worst = 0.0
    for name, (shape, box, local) in engine.local_shards().items():
        assert shape == tuple(truth[name].shape), name
        expected = layout.box(name, shape, rank)
        assert (expected is None and box.empty) or expected == box, (name, box, expected)
        assert local.data_ptr() == dict(engine.model.named_parameters())[name].to_local().data_ptr(), name
        if not box.empty:
            worst = max(worst, max_abs_diff(local, truth[name][box.slices()]))
    return worst


def compare_forward_and_step(engine, mine, rows, ref, errors: dict, tag: str, *, head: str, temperature: float = 1.0,
                             after_forward=None) -> None:
    """errors[tag/...]: the engine's forward outputs on its share `mine` (rows `rows` of the batch) and one
    training step's loss, grad norm and new weights, against the one-process `ref` (outputs at `temperature`)."""
    mask = mine["response_mask"]
    if head == "lm":
        out = engine.forward_log_probs(mine, temperature=temperature, with_entropy=True)
        errors[f"{tag}/log_probs"] = max_abs_diff(out["log_probs"], ref["out"]["log_probs"][rows], mask)
        errors[f"{tag}/entropy"] = max_abs_diff(out["entropy"], ref["out"]["entropy"][rows], mask)
    else:
        out = engine.forward_values(mine)
        errors[f"{tag}/values"] = max_abs_diff(out, ref["out"]["values"][rows], mask)
    for key, value in (after_forward() if after_forward else {}).items():
        errors[f"{tag}/{key}"] = value
    if head == "lm":
        metrics = engine.train_step(policy_loss, mine, with_entropy=True)
    else:
        metrics = engine.train_step(value_loss, mine)
    errors[f"{tag}/loss"] = abs(metrics["loss"] - ref["step"]["loss"])
    errors[f"{tag}/grad_norm"] = abs(metrics["grad_norm"] - ref["step"]["grad_norm"])
    new = engine.full_state_dict()
    assert new.keys() == ref["step"]["state"].keys(), sorted(set(new) ^ set(ref["step"]["state"]))
    errors[f"{tag}/new_weights"] = max(max_abs_diff(new[k], ref["step"]["state"][k]) for k in new)


def single_process(path, head: str, batch, *, temperature: float = 1.0, **hp) -> dict:
    """The one-process truth an engine layout is compared with: the initial weights, the outputs on
    `batch` (log-probs at `temperature` for "lm"), and one full-batch step (`reference_step`, `hp`)."""
    model = build_reference(path, head=head)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = reference_outputs(model, batch, head=head, temperature=temperature if head == "lm" else 1.0)
    step = reference_step(model, batch, policy_loss if head == "lm" else value_loss, head=head, **hp)
    return {"init": init, "out": out, "step": step}


def empty_minibatch_errors(engine, batch) -> dict[str, float]:
    """A mini-batch whose every response token an off-policy correction dropped: with allow_empty the
    step is skipped (reported `empty`, weights, optimizer steps and lr unchanged), without it an error,
    for both loss weightings that count tokens. Returns {check: error} (0 when it holds)."""
    empty = {**batch, "response_mask": torch.zeros_like(batch["response_mask"])}
    before, steps, lr = engine.full_state_dict(), engine.steps, engine.lr
    errors = {}
    for weighting in ("global", "tokens"):
        m = engine.train_step(policy_loss, empty, with_entropy=True, loss_weighting=weighting, allow_empty=True)
        errors[f"empty/{weighting}/reported"] = abs(m.get("empty", 0.0) - 1.0) + abs(m["skipped"])
        try:
            engine.train_step(policy_loss, empty, with_entropy=True, loss_weighting=weighting)
            errors[f"empty/{weighting}/raises_without_allow_empty"] = 1.0
        except ValueError:
            errors[f"empty/{weighting}/raises_without_allow_empty"] = 0.0
    after = engine.full_state_dict()
    errors["empty/weights_unchanged"] = max(max_abs_diff(after[k], before[k]) for k in before)
    errors["empty/no_optimizer_step"] = float(engine.steps - steps) + abs(engine.lr - lr)
    return errors
