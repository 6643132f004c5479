"""The megatron engine's CPU-testable half, on real megatron-core modules and gloo processes.

Forward, backward, optimizer and checkpoints are tested against the fsdp engine in
test_engine_cpu.py. Here: the model built from a
HF config has exactly the parameters the HF -> Megatron conversion produces (names and per-rank
shapes, strict), for Qwen2/Llama at tp 1/2/4 and pp 1/2; every rank's parameters, converted back to
HF shards with their layout boxes, tile the HF checkpoint exactly; megatron-core's own parallel
coordinates equal the resharding layout's; and the critic's value head round-trips as `score`.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from rlframe.resharding.layout import Layout  # noqa: E402
from rlframe.utils.spawn import run_distributed  # noqa: E402
from tests.workers.engines.megatron.models import build_hf_model  # noqa: E402


def _build(rank, world, tp, pp, model_path, head):
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from rlframe.workers.engines.megatron.model import (
        build_model, check_hf_config, init_model_parallel, transformer_config,
    )
    from rlframe.workers.engines.megatron.weights import load_hf_weights

    init_model_parallel(tp=tp, pp=pp, seed=0)
    hf_config = AutoConfig.from_pretrained(model_path)
    dims = check_hf_config(hf_config, tp=tp, pp=pp, where=model_path)
    cfg = transformer_config(hf_config, tp=tp, pp=pp, sequence_parallel=False, params_dtype=torch.float32,
                             cpu_init=True)
    model = build_model(hf_config, head=head, config=cfg, pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage(), device=torch.device("cpu"))
    layout = Layout(tp=tp, dp=world // (tp * pp), pp=pp)
    megatron_coords = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                       ps.get_data_parallel_rank())
    fresh = load_hf_weights(model, model_path=model_path, dims=dims, head=head, layout=layout, rank=rank, seed=3)
    return model, dims, layout, megatron_coords, fresh


def _build_and_read_back(rank, world, tp, pp, model_path, head):
    from rlframe.workers.engines.megatron.weights import hf_shards

    model, dims, layout, megatron_coords, fresh = _build(rank, world, tp, pp, model_path, head)
    # numpy: tensors would travel back through shared memory that dies with the process
    shards = {n: (box, t.numpy().copy()) for n, (_, box, t) in hf_shards(model, dims=dims, head=head, layout=layout,
                                                                 rank=rank).items()}
    return {"coords": megatron_coords, "layout_coords": layout.coords_of(rank), "fresh": fresh, "shards": shards,
            "num_params": sum(p.numel() for p in model.parameters())}


def _hf_state(path):
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_models")
    return {f: build_hf_model(str(root / f), f) for f in ("qwen2", "llama")}


# every layout once, and tp2 x pp2 with both families (qwen2: qkv bias; llama: head_dim != hidden / heads)
@pytest.mark.parametrize("family,tp,pp", [("qwen2", 1, 1), ("qwen2", 2, 1), ("llama", 4, 1), ("llama", 1, 2),
                                          ("qwen2", 2, 2), ("llama", 2, 2)])
def test_hf_checkpoint_round_trips_through_megatron_modules(hf_models, family, tp, pp):
    path = hf_models[family]
    world = tp * pp * (2 if tp * pp == 1 else 1)  # one case with two data-parallel replicas
    outs = run_distributed(_build_and_read_back, world_size=world, args=(tp, pp, path, "lm"))
    full = _hf_state(path)
    rebuilt = {n: torch.full_like(t, float("nan")) for n, t in full.items()}
    for rank, out in enumerate(outs):
        assert out["coords"] == out["layout_coords"], f"rank {rank}: megatron-core and the layout disagree"
        assert out["fresh"] == []
        for name, (box, t) in out["shards"].items():
            t = torch.from_numpy(t)
            assert torch.equal(t, full[name][box.slices()]), (rank, name)
            rebuilt[name][box.slices()] = t
    assert all(torch.equal(rebuilt[n], full[n]) for n in full), "the ranks' shards do not tile the checkpoint"
    # tp shards add up to the model once per pipeline (dp replicas aside)
    replicas = world // (tp * pp)
    per_pipeline = sum(o["num_params"] for o in outs) // replicas
    replicated = sum(t.numel() for n, t in full.items() if "norm" in n or n.endswith("o_proj.bias"))
    assert per_pipeline == sum(t.numel() for t in full.values()) + (tp - 1) * replicated


def test_critic_value_head_is_score(hf_models):
    path = hf_models["qwen2"]
    outs = run_distributed(_build_and_read_back, world_size=2, args=(2, 1, path, "value"))
    full = _hf_state(path)
    for out in outs:
        assert out["fresh"] == ["score.weight", "score.bias"]  # a causal LM has no critic head yet
        assert "lm_head.weight" not in out["shards"]
        assert out["shards"]["score.weight"][1].shape == (1, 64)
        assert torch.equal(torch.from_numpy(out["shards"]["model.norm.weight"][1]), full["model.norm.weight"])
    # the fresh head is replicated over tp: the same on both ranks
    assert (outs[0]["shards"]["score.weight"][1] == outs[1]["shards"]["score.weight"][1]).all()


def test_layout_errors_are_clear(hf_models):
    from transformers import AutoConfig

    from rlframe.workers.engines.megatron.model import check_hf_config

    cfg = AutoConfig.from_pretrained(hf_models["qwen2"])
    with pytest.raises(ValueError, match=r"num_hidden_layers\(4\) % pp\(3\)"):
        check_hf_config(cfg, tp=1, pp=3, where="m")
    with pytest.raises(ValueError, match=r"num_kv_heads\(4\) % tp\(8\)"):
        check_hf_config(cfg, tp=8, pp=1, where="m")
    cfg.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        check_hf_config(cfg, tp=1, pp=1, where="m")


def _sync_to_generation_layout(rank, world, tp, pp, model_path, gen_tp):
    """The actor's weight sync, from megatron-built shards: plan megatron (tp, pp) -> vLLM tp slices
    (padded vocabulary), run it on gloo, and return what each generation rank received; plus the
    full state gathered the way full_state_dict / export_hf do."""
    from rlframe.resharding.executor import ShardAssembler, execute_plan
    from rlframe.resharding.planner import plan_reshard
    from rlframe.workers.engines.megatron.checkpoint import gather_hf
    from rlframe.workers.engines.megatron.weights import hf_param_metas, hf_shards
    from rlframe.workers.rollout.weight_sync import vllm_tp_box

    model, dims, layout, _, _ = _build(rank, world, tp, pp, model_path, "lm")
    shards = hf_shards(model, dims=dims, head="lm", layout=layout, rank=rank)
    dst = Layout(tp=gen_tp, dp=world // gen_tp)

    def vllm_box(name, shape, r):
        return vllm_tp_box(name, shape, tp_rank=dst.coords_of(r)[1], tp_size=gen_tp,
                           num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim)

    plan = plan_reshard(hf_param_metas(dims, head="lm", dtype=torch.float32), src=layout, dst=dst, num_layers=dims.num_layers, dst_box=vllm_box)
    got = {}

    def keep(done):
        for name, box, t in done:
            got[name] = (box, t.numpy().copy())

    boxes = {n: b for (n, r), b in plan.dst_boxes.items() if r == rank}
    stats = execute_plan(plan, local={n: t for n, (_, _, t) in shards.items()}, consumer=ShardAssembler(boxes, keep))
    full = gather_hf(shards, src=layout, dst=Layout(dp=world), dims=dims, head="lm", rank=rank,
                     device=torch.device("cpu"))
    return {"got": got, "gen_tp_rank": dst.coords_of(rank)[1], "received": stats.bytes_received,
            "full": {n: t.numpy() for n, t in full.items()}}


# tp2 x pp2 runs in test_engine_cpu.py's equivalence test; these two cover tp and pp splits into vLLM's slices
@pytest.mark.parametrize("tp,pp,gen_tp", [(4, 1, 2), (1, 2, 4)])
def test_megatron_weights_synced_into_generation_layout_equal_source(hf_models, tp, pp, gen_tp):
    from rlframe.workers.rollout.weight_sync import vllm_tp_box

    path = hf_models["llama"]
    full = _hf_state(path)
    outs = run_distributed(_sync_to_generation_layout, world_size=4, args=(tp, pp, path, gen_tp))
    for rank, out in enumerate(outs):
        assert out["got"].keys() == full.keys()
        for name, (box, t) in out["got"].items():
            expect = vllm_tp_box(name, full[name].shape, tp_rank=out["gen_tp_rank"], tp_size=gen_tp,
                                 num_kv_heads=4, head_dim=16)
            assert box == expect
            # vLLM pads the vocabulary; rows past the real vocabulary are not the model's
            real = box.intersect(type(box).full(full[name].shape))
            assert torch.equal(torch.from_numpy(t)[real.relative_to(box).slices()], full[name][real.slices()]), name
        # full_state_dict's gather is the checkpoint, on every rank
        assert all(torch.equal(torch.from_numpy(out["full"][n]), full[n]) for n in full)


def test_causal_padding_mask():
    from rlframe.workers.engines.megatron.inputs import causal_padding_mask

    am = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    mask = causal_padding_mask(am)
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    for b in range(2):
        for i in range(5):
            for j in range(5):
                assert bool(mask[b, 0, i, j]) == (not (j <= i and am[b, j] == 1))


def test_megatron_inputs_left_align_and_cut_to_the_longest_sample():
    """Rows are moved to column 0 (megatron's rotary positions are the columns) and the micro-batch keeps
    its longest sample's width, rounded up to the sequence-parallel multiple; outputs go back in place."""
    from rlframe.utils.masks import position_ids_from_mask
    from rlframe.workers.engines.megatron.inputs import megatron_inputs

    am = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1, 0, 0]])
    ids = torch.arange(1, 25).view(3, 8)
    data = {"input_ids": ids, "attention_mask": am, "position_ids": position_ids_from_mask(am), "responses": ids[:, 5:]}
    x = megatron_inputs(data, pad_token_id=0)
    assert x.input_ids.tolist() == [[4, 5, 6, 0, 0], [11, 12, 13, 14, 15], [22, 0, 0, 0, 0]]
    # the first valid token is at position 0 (the column) as in position_ids; padding after the run
    assert x.position_ids.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert x.labels[0, :3].tolist() == [5, 6, 7] and x.labels[2, 0].item() == 23  # the batch's next tokens
    assert x.stats == {"tokens_valid": 9, "tokens_computed": 15, "tokens_padded": 24}
    assert x.mask.shape == (3, 1, 5, 5) and bool(x.mask[0, 0, 4, 3]) and not bool(x.mask[1, 0, 4, 0])
    back = x.to_batch(x.input_ids.float())
    assert torch.equal(back, (ids * am).float())
    assert megatron_inputs(data, pad_token_id=0, multiple_of=4).input_ids.shape == (3, 8)
    one = megatron_inputs({k: v[2:] for k, v in data.items()}, pad_token_id=0, multiple_of=2)
    assert one.input_ids.tolist() == [[22, 0]] and one.stats["tokens_computed"] == 2


def test_cpu_compat_refuses_an_unchecked_megatron_version():
    from rlframe.workers.engines.megatron import cpu_compat

    cpu_compat.check_version(cpu_compat.CHECKED_VERSION)
    with pytest.raises(ValueError, match=r"megatron-core 0\.17\.0 is installed.*checked against 0\.16\.1.*strategy=fsdp"):
        cpu_compat.check_version("0.17.0")
