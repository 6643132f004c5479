"""Vocab-parallel log-prob/entropy with one slice (= whole vocab) against log_softmax and autograd.

Slices over several ranks (tp = 2) are covered by the layout test in test_engine.py.
"""

import torch

from rlframe.workers.engines.fsdp.vocab_parallel import vocab_parallel_log_probs


def test_values_and_gradients_match_log_softmax():
    torch.manual_seed(0)
    logits = (3 * torch.randn(7, 11, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 11, (7,))
    w1, w2 = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)

    lp, ent = vocab_parallel_log_probs(logits, labels, vocab_start=0, with_entropy=True)
    (g,) = torch.autograd.grad((lp * w1 + ent * w2).sum(), logits)

    ref_logits = logits.detach().clone().requires_grad_()
    logp = torch.log_softmax(ref_logits, -1)
    ref_lp = logp.gather(-1, labels[:, None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_g,) = torch.autograd.grad((ref_lp * w1 + ref_ent * w2).sum(), ref_logits)

    assert torch.allclose(lp, ref_lp, atol=1e-12)
    assert torch.allclose(ent, ref_ent, atol=1e-12)
    assert torch.allclose(g, ref_g, atol=1e-12)



def test_gradients_when_only_one_output_is_used():
    """Entropy only logged (or only entropy trained): the unused output's backward term is skipped
    and the gradient equals log_softmax's."""
    torch.manual_seed(1)
    logits = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (5,))
    logp = torch.log_softmax(logits, -1)
    ref = {"log_probs": logp.gather(-1, labels[:, None]).sum(), "entropy": -(logp.exp() * logp).sum()}
    for used, index in (("log_probs", 0), ("entropy", 1)):
        out = vocab_parallel_log_probs(logits, labels, vocab_start=0, with_entropy=True)
        (g,) = torch.autograd.grad(out[index].sum(), logits)
        (ref_g,) = torch.autograd.grad(ref[used], logits, retain_graph=True)
        assert torch.allclose(g, ref_g, atol=1e-12), used
