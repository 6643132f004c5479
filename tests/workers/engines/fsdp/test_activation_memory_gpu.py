"""On a GPU (NCCL, one rank): activation checkpointing lowers the peak CUDA memory a training step of
the fsdp engine adds over the model and optimizer state, and gives the same loss. The model is
small and the sequences long, so activations dominate the step. Run: `pytest -m gpu tests/workers/engines/fsdp`.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

from rlframe.utils.spawn import run_distributed  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("act_ckpt_gpu") / "qwen2"
    cfg = Qwen2Config(vocab_size=128, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def _step_peaks(rank, world, path):
    from rlframe.workers.engines import TrainEngineConfig, get_train_engine
    from tests.workers.engines.reference import make_batch, sft_loss

    batch = make_batch(batch_size=8, prompt_len=256, response_len=768, vocab=128)
    out = {}
    for on in (False, True):
        engine = get_train_engine("fsdp")(TrainEngineConfig(model_path=path, lr=1e-4, activation_checkpointing=on,
                                                             micro_batch_size=8))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = engine.train_step(sft_loss, batch)["loss"]
        torch.cuda.synchronize()
        out[on] = {"peak_over_base": torch.cuda.max_memory_allocated() - base, "loss": loss}
        del engine
        torch.cuda.empty_cache()
    return out


def test_checkpointing_lowers_the_step_peak(model_path):
    out = run_distributed(_step_peaks, world_size=1, args=(model_path,), backend="nccl", timeout_s=300)[0]
    off, on = out[False], out[True]
    print(f"\nstep peak over model+state: off {off['peak_over_base'] / 2**20:.0f} MiB, "
          f"on {on['peak_over_base'] / 2**20:.0f} MiB")
    assert on["peak_over_base"] < 0.5 * off["peak_over_base"], out
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-3), out
