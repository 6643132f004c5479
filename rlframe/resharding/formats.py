"""Format conversion between HF, Megatron-core and vLLM tensor-parallel layouts (pure functions).

Movement (planner/executor) works in HF names and Megatron-style TP slices; these functions only
rename and re-pack the tensors one TP rank holds. All take and return {name: tensor} dicts.

- HF: separate q/k/v, gate/up; layers `model.layers.{i}.`.
- Megatron-core, per TP rank and PP stage (layer numbers local to the stage):
  `decoder.layers.{i}.self_attention.linear_qkv.weight` packs, for each of the rank's query groups,
  [the group's q heads..., its k head, its v head] (grouped-query attention); `mlp.linear_fc1.weight`
  is [gate_shard; up_shard]; plus `embedding.word_embeddings.weight`, `output_layer.weight`,
  `decoder.final_layernorm.weight`. The norms depend on the layer spec (`spec`): Transformer Engine's
  ("te") fuses them into `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`, the local
  (torch) spec ("local") names them `input_layernorm.weight` / `pre_mlp_layernorm.weight`.
  A critic (`head="value"`) has HF `score.*` (Linear(hidden, 1)) where Megatron has `output_layer.*`.
- vLLM, per TP rank: `self_attn.qkv_proj` = cat(q_shard, k_shard, v_shard) on dim 0 and
  `mlp.gate_up_proj` = cat(gate_shard, up_shard) on dim 0 (biases alike); other names unchanged.

Shapes (per TP rank t of tp, H = hidden, hd = head_dim, nq/nkv = query/kv heads, I = intermediate):
q (nq/tp*hd, H), k and v (nkv/tp*hd, H), qkv ((nq+2*nkv)/tp*hd, H); gate/up (I/tp, H), fc1 (2*I/tp, H).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rlframe.resharding.layout import stage_layer_range


@dataclass(frozen=True)
class ModelDims:
    """The dimensions conversion and parameter listing need (Llama/Qwen2 decoder-only models)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None
    qkv_bias: bool = False
    tied_embeddings: bool = False  # the LM head is the embedding (no lm_head.weight of its own)

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads({self.num_heads}) % num_kv_heads({self.num_kv_heads}) != 0: not GQA")

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelDims":
        return cls(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                   num_kv_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
                   vocab_size=cfg.vocab_size, head_dim=getattr(cfg, "head_dim", None),
                   qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
                   tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))

    @staticmethod
    def config_namespace(raw: dict):
        """A config.json's dict as the attribute object `from_hf_config` reads, with the defaults of
        transformers' Llama config for keys a file may leave out (no weights, no transformers import)."""
        from types import SimpleNamespace

        return SimpleNamespace(**{"num_key_value_heads": raw.get("num_attention_heads"), "model_type": "llama",
                                  "tie_word_embeddings": False, **raw})

    def check_tp(self, tp: int) -> None:
        if self.num_kv_heads % tp:
            raise ValueError(
                f"num_kv_heads({self.num_kv_heads}) % tp({tp}) != 0: fused QKV packing needs whole kv heads per "
                "TP rank (vLLM replicates kv heads when tp > num_kv_heads, which these layouts do not do); lower tp"
            )


def hf_param_shapes(dims: ModelDims) -> dict[str, tuple[int, ...]]:
    """HF parameter names -> global shapes of a Llama/Qwen2 model, in model order (no lm_head.weight
    when the embeddings are tied, as in the model's own named_parameters())."""
    H, hd, I = dims.hidden_size, dims.head_dim, dims.intermediate_size
    out = {"model.embed_tokens.weight": (dims.vocab_size, H)}
    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        for proj, heads in (("q", dims.num_heads), ("k", dims.num_kv_heads), ("v", dims.num_kv_heads)):
            out[p + f"self_attn.{proj}_proj.weight"] = (heads * hd, H)
            if dims.qkv_bias:
                out[p + f"self_attn.{proj}_proj.bias"] = (heads * hd,)
        out[p + "self_attn.o_proj.weight"] = (H, dims.num_heads * hd)
        out[p + "post_attention_layernorm.weight"] = (H,)
        out[p + "mlp.gate_proj.weight"] = (I, H)
        out[p + "mlp.up_proj.weight"] = (I, H)
        out[p + "mlp.down_proj.weight"] = (H, I)
    out["model.norm.weight"] = (H,)
    if not dims.tied_embeddings:
        out["lm_head.weight"] = (dims.vocab_size, H)
    return out


# ---------------------------------------------------------------- HF <-> Megatron-core
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MEG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_PLAIN_HF_TO_MEG = {
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_NORMS_HF_TO_MEG = {
    "te": {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
           "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"},
    "local": {"input_layernorm.weight": "input_layernorm.weight",
              "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"},
}
MEGATRON_SPECS = tuple(_NORMS_HF_TO_MEG)
# megatron_to_hf reads either spec's names.
_PLAIN_MEG_TO_HF = {v: k for d in (_PLAIN_HF_TO_MEG, *_NORMS_HF_TO_MEG.values()) for k, v in d.items()}
_TOP_HF_TO_MEG = {
    "lm": {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
           "model.norm.weight": "decoder.final_layernorm.weight", "lm_head.weight": "output_layer.weight"},
    "value": {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
              "model.norm.weight": "decoder.final_layernorm.weight", "score.weight": "output_layer.weight",
              "score.bias": "output_layer.bias"},
}
_TOP_MEG_TO_HF = {head: {v: k for k, v in d.items()} for head, d in _TOP_HF_TO_MEG.items()}


def _check_spec_head(spec: str, head: str) -> None:
    if spec not in MEGATRON_SPECS:
        raise ValueError(f"megatron layer spec {spec!r} is unknown; use one of {MEGATRON_SPECS}")
    if head not in _TOP_HF_TO_MEG:
        raise ValueError(f"head {head!r} is unknown; use 'lm' or 'value'")


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int) -> torch.Tensor:
    """Megatron GQA packing of one TP rank: per query group [q heads of the group..., k, v] on dim 0.

    q (G*r*hd, ...), k and v (G*hd, ...) with G = `groups` local kv heads -> (G*(r+2)*hd, ...).
    """
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def unpack_qkv(qkv: torch.Tensor, *, groups: int, q_per_group: int) -> tuple[torch.Tensor, ...]:
    """Inverse of `pack_qkv`: q_per_group = query heads per kv head (r)."""
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, q_per_group + 2, -1, *rest)  # (G, r+2, hd, ...)
    q, k, v = g[:, :q_per_group], g[:, q_per_group], g[:, q_per_group + 1]
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], *, dims: ModelDims, tp: int, pp: int = 1,
                   pp_rank: int = 0, spec: str = "local", head: str = "lm") -> dict[str, torch.Tensor]:
    """One (tp rank, pp stage)'s HF shards -> its megatron-core tensors (stage-local layer numbers)."""
    dims.check_tp(tp)
    _check_spec_head(spec, head)
    top, plain = _TOP_HF_TO_MEG[head], {**_PLAIN_HF_TO_MEG, **_NORMS_HF_TO_MEG[spec]}
    first = stage_layer_range(dims.num_layers, pp=pp, stage=pp_rank).start
    groups = dims.num_kv_heads // tp
    out, layers = {}, {}
    for name, t in hf.items():
        if name in top:
            out[top[name]] = t
            continue
        m = _HF_LAYER.match(name)
        if m is None:
            raise ValueError(f"unexpected HF parameter {name!r}: not a Llama/Qwen2 decoder parameter")
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = t
    for i, ps in layers.items():
        pre = f"decoder.layers.{i - first}."
        for suffix in ("weight", "bias"):
            if f"self_attn.q_proj.{suffix}" in ps:
                out[pre + f"self_attention.linear_qkv.{suffix}"] = pack_qkv(
                    ps.pop(f"self_attn.q_proj.{suffix}"), ps.pop(f"self_attn.k_proj.{suffix}"),
                    ps.pop(f"self_attn.v_proj.{suffix}"), groups=groups)
        if "mlp.gate_proj.weight" in ps:
            out[pre + "mlp.linear_fc1.weight"] = torch.cat([ps.pop("mlp.gate_proj.weight"), ps.pop("mlp.up_proj.weight")])
        for key, t in ps.items():
            if key not in plain:
                raise ValueError(f"no Megatron name for HF parameter model.layers.{i}.{key}")
            out[pre + plain[key]] = t
    return out


def megatron_to_hf(meg: dict[str, torch.Tensor], *, dims: ModelDims, tp: int, pp: int = 1,
                   pp_rank: int = 0, head: str = "lm") -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron` for one (tp rank, pp stage); reads either layer spec's names."""
    dims.check_tp(tp)
    _check_spec_head("local", head)
    top = _TOP_MEG_TO_HF[head]
    first = stage_layer_range(dims.num_layers, pp=pp, stage=pp_rank).start
    groups, r = dims.num_kv_heads // tp, dims.num_heads // dims.num_kv_heads
    out = {}
    for name, t in meg.items():
        if name in top:
            out[top[name]] = t
            continue
        m = _MEG_LAYER.match(name)
        if m is None:
            raise ValueError(f"unexpected Megatron parameter {name!r}")
        pre, key = f"model.layers.{int(m.group(1)) + first}.", m.group(2)
        if key.startswith("self_attention.linear_qkv.") and key.rsplit(".", 1)[1] in ("weight", "bias"):
            suffix = key.rsplit(".", 1)[1]
            for proj, x in zip("qkv", unpack_qkv(t, groups=groups, q_per_group=r)):
                out[pre + f"self_attn.{proj}_proj.{suffix}"] = x
        elif key == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[pre + "mlp.gate_proj.weight"], out[pre + "mlp.up_proj.weight"] = gate, up
        elif key in _PLAIN_MEG_TO_HF:
            out[pre + _PLAIN_MEG_TO_HF[key]] = t
        else:
            raise ValueError(f"no HF name for Megatron parameter {name!r}")
    return out


# ---------------------------------------------------------------- HF <-> vLLM
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
FUSED_MODULES = _FUSED  # public name: vLLM fused module -> the HF modules it concatenates on dim 0


def hf_to_vllm(hf: dict[str, torch.Tensor], *, dims: ModelDims, tp: int) -> dict[str, torch.Tensor]:
    """One TP rank's HF shards -> vLLM's fused per-rank tensors (qkv_proj, gate_up_proj)."""
    dims.check_tp(tp)
    out = dict(hf)
    for name in list(hf):
        for fused, parts in _FUSED.items():
            if f".{parts[0]}." not in name:
                continue
            names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            if any(n not in hf for n in names):
                raise ValueError(f"{name!r} is present but not all of {names}: vLLM fuses them together")
            out[name.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([hf[n] for n in names], dim=0)
            for n in names:
                del out[n]
    return out


def vllm_to_hf(vl: dict[str, torch.Tensor], *, dims: ModelDims, tp: int) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_vllm` for one TP rank."""
    dims.check_tp(tp)
    if dims.intermediate_size % tp:
        raise ValueError(f"intermediate_size({dims.intermediate_size}) % tp({tp}) != 0: gate_up_proj cannot be split evenly")
    hd = dims.head_dim
    sizes = {"self_attn.qkv_proj": [dims.num_heads // tp * hd] + [dims.num_kv_heads // tp * hd] * 2,
             "mlp.gate_up_proj": [dims.intermediate_size // tp] * 2}
    out = {}
    for name, t in vl.items():
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            out[name] = t
            continue
        for part, x in zip(_FUSED[fused], torch.split(t, sizes[fused], dim=0)):
            out[name.replace(f".{fused}.", f".{part}.")] = x
    return out
