"""Accuracy of a (tiny) causal LM on (prompt, answer) pairs: greedy accuracy and pass@k.

Used to document the pre-trained demo model before RL (docs/tiny_model.md) and by the tests.
A sample counts as correct only when it is exactly the answer followed by EOS within the token
budget: the same format the arithmetic reward checks after decoding. Prompts are grouped by
token length so that no padding is needed, which keeps positions identical to training and to
vLLM (no left-padding position-id conventions involved).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class EvalResult:
    n: int
    greedy_acc: float
    pass_at_k: float
    sample_acc: float
    format_rate: float
    k: int


def is_correct(tokenizer, ids: list[int], answer: str) -> tuple[bool, bool]:
    """(correct, well_formed): well-formed = the response ends with EOS inside the budget."""
    eos = tokenizer.eos_token_id
    if eos not in ids:
        return False, False
    text = tokenizer.decode(ids[: ids.index(eos)], skip_special_tokens=True)
    return text.strip() == answer, True


def generate_grouped(model, tokenizer, prompts: list[str], *, num: int, sample: bool, max_new_tokens: int):
    """Yield (prompt_index, list of `num` response id lists) for every prompt."""
    import torch

    groups: dict[int, list[int]] = defaultdict(list)
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for i, ids in enumerate(encoded):
        groups[len(ids)].append(i)
    for length, members in sorted(groups.items()):
        ids = torch.tensor([encoded[i] for i in members])
        kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            num_return_sequences=num,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        )
        resp = out[:, length:].tolist()
        for j, i in enumerate(members):
            yield i, resp[j * num : (j + 1) * num]


def evaluate_pairs(
    model, tokenizer, pairs: list[tuple[str, str]], *, k: int = 4, max_new_tokens: int = 8, seed: int = 0
) -> EvalResult:
    """Greedy accuracy, pass@k and per-sample accuracy at temperature 1 over `pairs`."""
    import torch

    prompts = [p for p, _ in pairs]
    greedy = [False] * len(pairs)
    formed = [False] * len(pairs)
    with torch.no_grad():
        greedy_out = generate_grouped(model, tokenizer, prompts, num=1, sample=False, max_new_tokens=max_new_tokens)
        for i, (resp,) in greedy_out:
            greedy[i], formed[i] = is_correct(tokenizer, resp, pairs[i][1])
        torch.manual_seed(seed)
        hits = [0] * len(pairs)
        for i, resps in generate_grouped(model, tokenizer, prompts, num=k, sample=True, max_new_tokens=max_new_tokens):
            hits[i] = sum(is_correct(tokenizer, r, pairs[i][1])[0] for r in resps)
    n = len(pairs)
    return EvalResult(
        n=n,
        greedy_acc=sum(greedy) / n,
        pass_at_k=sum(h > 0 for h in hits) / n,
        sample_acc=sum(hits) / (n * k),
        format_rate=sum(formed) / n,
        k=k,
    )


def evaluate_model_dir(model_dir, pairs: list[tuple[str, str]], **kwargs) -> EvalResult:
    """Load an HF model directory in fp32 and run `evaluate_pairs`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return evaluate_pairs(model, tok, pairs, **kwargs)
