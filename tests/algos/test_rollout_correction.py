"""Rollout corrections against a reference written independently: plain Python over each response's
list of valid tokens, from the definitions in the module's doc."""

import math
import random
import zlib

import pytest
import torch

from rlframe.algos.rollout_correction import correct

METHODS = ("none", "tis", "seq_tis", "icepop", "seq_mask_tis", "mis")


def reference(old, behaviour, adv, mask, *, method, cap, low, high, rejection_kl):
    """Per response: the list of (advantage, kept) of its valid tokens; padding stays (0-adv, not kept)."""
    out_adv, out_keep = [], []
    for o_row, b_row, a_row, m_row in zip(old, behaviour, adv, mask):
        idx = [j for j, v in enumerate(m_row) if v]
        rho = {j: math.exp(max(-20.0, min(20.0, o_row[j] - b_row[j]))) for j in idx}
        logs = [math.log(rho[j]) for j in idx]
        geo = math.exp(sum(logs) / len(idx)) if idx else 1.0
        seq = math.exp(max(-20.0, min(20.0, sum(logs))))
        kl = sum(rho[j] - 1 - math.log(rho[j]) for j in idx) / len(idx) if idx else 0.0
        drop_seq = (method in ("seq_mask_tis", "mis") and not low <= geo <= high) or \
                   (rejection_kl is not None and idx and kl > rejection_kl)
        a_out, k_out = [], []
        for j in range(len(m_row)):
            if j not in rho:
                a_out.append(0.0 if method != "none" or rejection_kl is not None else a_row[j])
                k_out.append(0)
                continue
            w = {"none": 1.0, "tis": min(rho[j], cap), "seq_mask_tis": min(rho[j], cap), "mis": 1.0,
                 "seq_tis": min(seq, cap), "icepop": rho[j]}[method]
            kept = not drop_seq and not (method == "icepop" and not low <= rho[j] <= high)
            a_out.append(a_row[j] * w if kept else 0.0)
            k_out.append(int(kept))
        out_adv.append(a_out)
        out_keep.append(k_out)
    return out_adv, out_keep


def random_batch(rng: random.Random, rows=6, width=7, spread=0.6):
    old = [[rng.gauss(-1.5, 0.5) for _ in range(width)] for _ in range(rows)]
    behaviour = [[o + rng.gauss(0, spread) for o in row] for row in old]
    adv = [[rng.gauss(0, 1) for _ in range(width)] for _ in range(rows)]
    lengths = [rng.randint(0 if r == rows - 1 else 1, width) for r in range(rows)]  # the last may be empty
    mask = [[1 if j < n else 0 for j in range(width)] for n in lengths]
    return old, behaviour, adv, mask


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rejection_kl", [None, 0.05])
@pytest.mark.parametrize("band", [(None, None), (0.8, 1.25)])
def test_each_method_matches_the_reference(method, rejection_kl, band):
    rng = random.Random(zlib.crc32(repr((method, rejection_kl, band)).encode()))
    low, high = band
    defaults = {"icepop": (0.5, 5.0), "seq_mask_tis": (0.5, 2.0), "mis": (0.5, 2.0)}.get(method, (0.0, math.inf))
    ref_low, ref_high = (defaults[0] if low is None else low), (defaults[1] if high is None else high)
    masked_seen = 0
    for _ in range(5):
        old, behaviour, adv, mask = random_batch(rng, spread=rng.choice([0.3, 1.5]))
        kwargs = dict(method=method, tis_cap=1.5, rejection_kl=rejection_kl)
        if method in defaults_of_masking():
            kwargs.update(low=low, high=high)
        got_adv, got_keep, m = correct(torch.tensor(old), torch.tensor(behaviour), torch.tensor(adv),
                                       torch.tensor(mask), **kwargs)
        want_adv, want_keep = reference(old, behaviour, adv, mask, method=method, cap=1.5, low=ref_low,
                                        high=ref_high, rejection_kl=rejection_kl)
        assert torch.allclose(got_adv, torch.tensor(want_adv), atol=1e-5), method
        assert got_keep.tolist() == want_keep
        valid = sum(map(sum, mask))
        if "async/masked_token_frac" in m:
            dropped = sum(m_ - k for mr, kr in zip(mask, want_keep) for m_, k in zip(mr, kr))
            assert m["async/masked_token_frac"] == pytest.approx(dropped / valid)
            masked_seen += dropped
    if method in defaults_of_masking() or rejection_kl is not None:
        assert masked_seen > 0, "the random batches never exercised the mask"


def defaults_of_masking():
    return ("icepop", "seq_mask_tis", "mis")


def test_weights_of_the_hand_example():
    """pi_old / pi_behaviour per token [1, 5, 0.5] and [0.25, 3, (padding)]."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2], [0.1, 0.9, 0.3]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.4], [0.4, 0.3, 0.3]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ones = torch.ones(2, 3)
    adv, keep, m = correct(old, behaviour, ones, mask, method="seq_tis", tis_cap=2.0)
    # products 2.5 (capped at 2) and 0.75
    assert torch.allclose(adv, torch.tensor([[2.0, 2.0, 2.0], [0.75, 0.75, 0.0]]))
    assert m["async/seq_is_weight_mean"] == pytest.approx((2.5 + 0.75) / 2)
    adv, keep, m = correct(old, behaviour, ones, mask, method="icepop", low=0.4, high=4.0)
    assert keep.tolist() == [[1, 0, 1], [0, 1, 0]]  # 5 and 0.25 are outside [0.4, 4]
    assert torch.allclose(adv, torch.tensor([[1.0, 0.0, 0.5], [0.0, 3.0, 0.0]]))
    assert m["async/masked_token_frac"] == pytest.approx(2 / 5) and m["async/masked_seq_frac"] == 0.0
    # geometric means 2.5 ** (1/3) = 1.357 and 0.75 ** (1/2) = 0.866: mis with [0.9, 1.2] drops both
    _, keep, m = correct(old, behaviour, ones, mask, method="mis", low=0.9, high=1.2)
    assert keep.sum() == 0 and m["async/masked_seq_frac"] == 1.0


def test_extreme_ratios_stay_finite():
    old = torch.tensor([[0.0, -100.0]])
    behaviour = torch.tensor([[-100.0, 0.0]])
    for method in METHODS:
        adv, _, m = correct(old, behaviour, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.long), method=method,
                            rejection_kl=1.0)
        assert torch.isfinite(adv).all() and all(math.isfinite(v) for v in m.values()), method


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="expected one of none, tis"):
        correct(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), method="behaviour")
