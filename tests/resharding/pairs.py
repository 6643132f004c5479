"""Layout pairs and the tiny model shared by the planner and executor tests."""

import torch

from rlframe.resharding.formats import ModelDims, hf_param_shapes
from rlframe.resharding.layout import Layout, hybridflow_generation_layout
from rlframe.resharding.planner import ParamMeta

# Small Qwen2-like shapes (qkv bias, GQA); 32 and 48 divide by 1, 2, 3, 4 so HybridFlow nests exactly.
DIMS = ModelDims(num_layers=2, hidden_size=24, num_heads=6, num_kv_heads=2, intermediate_size=48,
                 vocab_size=48, qkv_bias=True)
TRAINING = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 1), (1, 2, 2), (4, 1, 1)]  # (dp, tp, pp)
GEN_TP = (1, 2, 4)


def metas() -> dict[str, ParamMeta]:
    """Projections in bf16, everything else fp32: mixed dtypes exercise the byte packing."""
    out = {}
    for name, shape in hf_param_shapes(DIMS).items():
        dtype = torch.bfloat16 if "_proj." in name else torch.float32
        out[name] = ParamMeta(shape, dtype)
    return out


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(m.shape, generator=g).to(m.dtype) for n, m in metas().items()}


def layout_pairs() -> list[tuple[str, Layout, Layout, bool]]:
    """Every (training, generation) pair the issue asks for, plus split placement and odd TP ratios.

    For each training (dp, tp, pp), with dp replicating (Megatron) and, when dp > 1, sharding dim 0
    (FSDP), and each generation tp dividing the world size: the HybridFlow strided generation layout
    when it applies, and the plain Megatron-order one (what vLLM's consecutive TP groups give) when
    it differs. The last item of each tuple says whether the generation layout is HybridFlow's.
    """
    pairs = []
    for dp, tp, pp in TRAINING:
        world = dp * tp * pp
        for fsdp in ([False, True] if dp > 1 else [False]):
            src = Layout(tp=tp, dp=dp, pp=pp, fsdp=fsdp)
            for tg in GEN_TP:
                if world % tg:
                    continue
                tag = f"{'fsdp' if fsdp else 'megatron'}(dp={dp},tp={tp},pp={pp})->tp{tg}"
                plain = Layout(tp=tg, dp=world // tg)
                if tp % tg == 0:
                    hybrid = hybridflow_generation_layout(src, tp=tg)
                    pairs.append((tag + " hybridflow", src, hybrid, True))
                    if hybrid.coords == plain.coords:
                        continue
                pairs.append((tag, src, plain, False))
    # split placement: training on ranks 0-3, generation on ranks 4-7
    fsdp22 = Layout(tp=2, dp=2, fsdp=True)
    pairs.append(("split fsdp(dp=2,tp=2)->tp2 on 4-7", fsdp22, Layout(tp=2, dp=2, ranks=(4, 5, 6, 7)), False))
    pairs.append(("split megatron(dp=4)->tp4 on 4-7", Layout(dp=4), Layout(tp=4, ranks=(4, 5, 6, 7)), False))
    # t not divisible by t_g, and generation tp larger than training tp
    pairs.append(("megatron(dp=3,tp=2)->tp3", Layout(tp=2, dp=3), Layout(tp=3, dp=2), False))
    pairs.append(("fsdp(dp=4,tp=2)->tp4 (8 ranks)", Layout(tp=2, dp=4, fsdp=True), Layout(tp=4, dp=2), False))
    return pairs


def vllm_like_box(name: str, shape, rank: int):
    """A destination rule unlike Megatron's (tp=4 on ranks 0-3), as vLLM slices: vocabulary padded to
    a multiple of 32 before the split (rank 3 gets no rows of a 48-row vocabulary) and kv heads
    replicated when tp > num_kv_heads (ranks 0, 1 read kv head 0; ranks 2, 3 head 1)."""
    from rlframe.resharding.box import Box, chunk_box
    from rlframe.resharding.layout import hf_tp_split_dim

    tp, module = 4, name.split(".")[-2]
    dim = hf_tp_split_dim(name)
    if dim is None:
        return Box.full(shape)
    if module in ("embed_tokens", "lm_head"):
        per = -(-shape[0] // 32) * 32 // tp
        lo, hi = min(rank * per, shape[0]), min((rank + 1) * per, shape[0])
        return Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))
    if module in ("k_proj", "v_proj"):
        head = rank // (tp // DIMS.num_kv_heads)
        return Box((head * DIMS.head_dim,) + (0,) * (len(shape) - 1), (DIMS.head_dim,) + tuple(shape[1:]))
    return chunk_box(shape, dim=dim, index=rank, parts=tp)
