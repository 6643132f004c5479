"""Random right-padded batches for the algorithm tests, with the masking edge cases built in."""

import numpy as np
import pytest
import torch


def right_padded_mask(lengths, R):
    """(B, R) int64 mask with lengths[i] leading ones (responses are right-padded)."""
    return (torch.arange(R).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)).long()


@pytest.fixture
def token_batch():
    """make(B, R, seed): rewards, mask and lengths for B responses of at most R tokens.

    Row 0 is all-masked and row 1 has length 1 (the edge cases every algorithm must handle);
    the others have random lengths in [1, R]. Outcome rewards sit on the last valid token and
    small per-token rewards (a KL penalty, say) on the others.
    """

    def make(B=12, R=7, seed=0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, R + 1, (B,), generator=g)
        lengths[0], lengths[1] = 0, 1
        mask = right_padded_mask(lengths, R)
        rewards = 0.1 * torch.randn(B, R, generator=g) * mask
        for i in range(B):
            if lengths[i] > 0:
                rewards[i, lengths[i] - 1] += float(torch.randint(0, 2, (1,), generator=g))
        return rewards, mask, lengths

    return make


@pytest.fixture
def string_uids():
    """make(B, n): numpy object array of string group ids, n consecutive samples per prompt."""

    def make(B, n):
        return np.array([f"prompt-{i // n}" for i in range(B)], dtype=object)

    return make


def reference_agg(per_token, mask, mode, scale=None):
    """Aggregate {(i, t): loss} (scalars or scalar tensors) by looping over sequences.

    Rows without valid tokens are not sequences; returns 0.0 when nothing is valid.
    """
    B, R = mask.shape
    seqs = [[per_token[(i, t)] for t in range(R) if mask[i, t]] for i in range(B)]
    seqs = [s for s in seqs if s]
    if not seqs:
        return 0.0
    if mode == "token-mean":
        tokens = [v for s in seqs for v in s]
        return sum(tokens) / len(tokens)
    if mode == "seq-mean-token-sum":
        per_seq = [sum(s) for s in seqs]
    elif mode == "seq-mean-token-mean":
        per_seq = [sum(s) / len(s) for s in seqs]
    elif mode == "seq-mean-token-sum-norm":
        per_seq = [sum(s) / (scale if scale is not None else R) for s in seqs]
    else:
        raise AssertionError(mode)
    return sum(per_seq) / len(per_seq)


@pytest.fixture
def ref_agg():
    return reference_agg
