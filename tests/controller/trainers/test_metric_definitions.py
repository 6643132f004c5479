"""Every batch metric a step logs equals its definition in docs/metrics.md, recomputed here in plain
PyTorch from the batch the update received (a test observer on the trainer; real Ray, workers and
vLLM), in three of test_end_to_end.py's runs: PPO with a critic and the KL in the reward (adaptive
coefficient), GRPO with DAPO's length shaping and dynamic sampling, and online DPO (its metrics are
of the scored batch, before pairing; its pairs are checked on the batch its update gets). The rewards are
recomputed by calling the reward function on the decoded responses, independently of the run's
reward manager."""

import math

import pytest
import torch

from rlframe.rewards.registry import default_compute_score

# the runs of test_end_to_end.CASES these checks observe, and what each must exercise
RUNS = {
    "ppo": lambda cfg: cfg.uses_critic and cfg.algorithm.kl_in_reward and bool(cfg.algorithm.kl_target),
    "dapo": lambda cfg: cfg.algorithm.dynamic_sampling and cfg.algorithm.overlong_buffer_len > 0,
    "online_dpo": lambda cfg: cfg.algorithm.name == "online_dpo",
}


@pytest.fixture(scope="module", params=list(RUNS))
def recorded(request, dataflow_run):
    _, _, rec = dataflow_run(request.param)
    assert rec.steps and RUNS[request.param](rec.cfg), f"{request.param}: not the run these checks need"
    return request.param, rec


def _stats(name, x):
    return {f"{name}/mean": x.float().mean().item(), f"{name}/max": x.float().max().item(),
            f"{name}/min": x.float().min().item()}


def definitions(rec, batch) -> dict[str, float]:
    """docs/metrics.md, written out over the batch's tensors."""
    b, cfg = batch.batch, rec.cfg
    mask = b["response_mask"].bool()
    R = b["responses"].shape[1]
    attention = b["attention_mask"]
    occupied = attention[:, -R:].sum(-1)
    texts = [rec.tokenizer.decode([t for t, m in zip(r.tolist(), mk.tolist()) if m], skip_special_tokens=True)
             for r, mk in zip(b["responses"], mask)]
    nt = batch.non_tensor_batch
    scores = torch.tensor([float(default_compute_score(ds, text, gt, ei)) for ds, text, gt, ei in
                           zip(nt["data_source"], texts, nt["ground_truth"], nt["extra_info"])])
    out = {"reward/mean": scores.mean().item(), "critic/accuracy": (scores >= 1).float().mean().item(),
           **_stats("critic/score", b["token_level_scores"].sum(-1)),
           **_stats("response_length", mask.sum(-1)),
           **_stats("prompt_length", attention[:, :-R].sum(-1)),
           "response_length/empty_ratio": (~mask.any(-1)).float().mean().item(),
           "perf/total_num_tokens": float(attention.sum()), "perf/response_tokens": float(mask.sum())}
    cut = [int(n) >= cfg.data.response_length and int(r[int(n) - 1]) not in rec.end_ids
           for r, n in zip(b["responses"], occupied)]
    out["response_length/clip_ratio"] = sum(cut) / len(cut)
    for name, rows in (("correct", scores >= 1), ("incorrect", scores < 1)):
        if rows.any():
            out[f"response_length/{name}_mean"] = mask.sum(-1)[rows].float().mean().item()
    shaped = scores.clone()
    if cfg.algorithm.overlong_buffer_len:
        top, buf = cfg.data.response_length, cfg.algorithm.overlong_buffer_len
        penalty = torch.tensor([0.0 if n <= top - buf else -1.0 if n > top else ((top - buf) - n) / buf
                                for n in occupied.tolist()]) * cfg.algorithm.overlong_penalty_factor
        out["reward/overlong_penalty_mean"] = penalty.mean().item()
        shaped = shaped + penalty
    out["_score_is_shaped_reward"] = float(torch.allclose(b["token_level_scores"].sum(-1), shaped, atol=1e-6))
    if cfg.algorithm.dynamic_sampling:  # the rows trained on, and the share of them in groups whose rewards differ
        s, uids = b["token_level_scores"].sum(-1).tolist(), list(nt["uid"])
        differ = {u for u in set(uids) if len({v for v, w in zip(s, uids) if w == u}) > 1}
        out["dapo/trained_rows"] = float(len(uids))
        out["dapo/informative_ratio"] = sum(u in differ for u in uids) / len(uids)
    if "advantages" in b.keys():
        out.update({**_stats("critic/rewards", b["token_level_rewards"].sum(-1)),
                    **_stats("critic/advantages", b["advantages"][mask]), **_stats("critic/returns", b["returns"][mask])})
    if "values" in b.keys():
        out.update(_stats("critic/values", b["values"][mask]))
    if "old_log_probs" in b.keys() and "rollout_log_probs" in b.keys():
        gap = (b["rollout_log_probs"] - b["old_log_probs"]).abs()[mask]
        out.update({"rollout/logprob_diff_mean": gap.mean().item(), "rollout/logprob_diff_max": gap.max().item()})
    if "old_log_probs" in b.keys() and "ref_log_prob" in b.keys():
        kl = b["old_log_probs"] - b["ref_log_prob"]
        out["actor/reference_kl"] = kl[mask].mean().item()
        if cfg.algorithm.kl_in_reward:  # k1, mean over non-empty rows of each row's token mean
            rows = [kl[i][mask[i]].mean().item() for i in range(len(kl)) if mask[i].any()]
            out["actor/reward_kl_penalty"] = sum(rows) / len(rows)
    return out


def test_logged_metrics_equal_their_definitions(recorded):
    name, rec = recorded
    checked = set()
    for (batch, logged), scored in zip(rec.steps, rec.scored_batches):
        if name == "online_dpo":  # the update gets pairs; the batch metrics are of the scored batch before pairing
            uids = list(batch.non_tensor_batch["uid"])
            s = batch.batch["token_level_scores"].sum(-1)
            assert all(uids[i] == uids[i + 1] and s[i] > s[i + 1] for i in range(0, len(uids), 2))
            assert logged["dpo/pairs"] == len(set(uids))
            checked.add("dpo/pairs")
            batch = scored
        want = definitions(rec, batch)
        assert want.pop("_score_is_shaped_reward") == 1.0, "critic/score is not the reward plus its shaping"
        if "actor/kl_coef" in logged:  # the coefficient this step's rewards used, not the controller's next one
            assert logged["actor/kl_coef"] == logged["actor/reward_kl_penalty_coeff"], logged
            checked.add("actor/kl_coef")
        for key, value in want.items():
            assert key in logged, f"{name}: {key} is defined but not logged"
            assert math.isclose(logged[key], value, rel_tol=1e-5, abs_tol=1e-6), (name, key, logged[key], value)
            checked.add(key)
    assert len(checked) >= (15 if name == "online_dpo" else 20), sorted(checked)
    if name == "ppo":  # the adaptive controller moved between the steps, and the actor away from the reference:
        # the checks above are not vacuous
        assert rec.steps[0][1]["actor/kl_coef"] != rec.steps[1][1]["actor/kl_coef"]
        assert any(logged["actor/reward_kl_penalty"] != 0 for _, logged in rec.steps)
