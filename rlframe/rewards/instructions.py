"""Verifiable instruction-following constraints in the style of IFEval (Zhou et al., 2023,
"Instruction-Following Evaluation for Large Language Models") and IFBench.

Each constraint is a pure function `check(response, **kwargs) -> bool` registered under an id.
A sample's ground truth lists the constraints and their arguments:

    {"instruction_id_list": ["length:max_words", "case:lowercase"],
     "kwargs": [{"relation": "at most", "num_words": 50}, {}]}

`instruction_score` returns the fraction of constraints followed (or all-or-nothing when
`strict=True`). Unknown ids and bad arguments raise ValueError naming the constraint, so a broken
dataset row fails loudly once (it is then counted in `reward/errors` by the reward manager).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

RELATIONS = ("at least", "at most", "exactly", "less than", "more than")


def _compare(value: int, relation: str, target: int) -> bool:
    if relation == "at least":
        return value >= target
    if relation == "at most":
        return value <= target
    if relation == "exactly":
        return value == target
    if relation == "less than":
        return value < target
    if relation == "more than":
        return value > target
    raise ValueError(f"unknown relation {relation!r}; use one of {RELATIONS}")


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+(?:'\w+)?\b", text)


def _sentences(text: str) -> list[str]:
    # A sentence ends at . ! or ? followed by space/end; abbreviations are not special-cased.
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return [p for p in parts if re.search(r"\w", p)]


def word_count(response: str, *, relation: str, num_words: int) -> bool:
    return _compare(len(_words(response)), relation, num_words)


def sentence_count(response: str, *, relation: str, num_sentences: int) -> bool:
    return _compare(len(_sentences(response)), relation, num_sentences)


def paragraph_count(response: str, *, num_paragraphs: int) -> bool:
    """Paragraphs separated by the markdown divider '***' (IFEval's convention)."""
    parts = [p for p in re.split(r"\s*\*\*\*\s*", response.strip())]
    return len(parts) == num_paragraphs and all(p.strip() for p in parts)


def keyword_frequency(response: str, *, keyword: str, relation: str, frequency: int) -> bool:
    found = re.findall(r"\b" + re.escape(keyword) + r"\b", response, flags=re.IGNORECASE)
    return _compare(len(found), relation, frequency)


def include_keywords(response: str, *, keywords: list[str]) -> bool:
    return all(re.search(r"\b" + re.escape(k) + r"\b", response, flags=re.IGNORECASE) for k in keywords)


def forbidden_words(response: str, *, forbidden_words: list[str]) -> bool:
    return not any(re.search(r"\b" + re.escape(w) + r"\b", response, flags=re.IGNORECASE) for w in forbidden_words)


def forbidden_characters(response: str, *, characters: str) -> bool:
    return not any(ch in response for ch in characters)


def no_comma(response: str) -> bool:
    return "," not in response


def json_format(response: str) -> bool:
    """The whole response is JSON (a ```json fenced block is accepted, as in IFEval)."""
    text = response.strip()
    fenced = re.fullmatch(r"```(?:json|JSON|Json)?\s*(.*?)\s*```", text, flags=re.S)
    if fenced:
        text = fenced.group(1)
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def lowercase(response: str) -> bool:
    return response == response.lower() and any(c.isalpha() for c in response)


def uppercase(response: str) -> bool:
    return response == response.upper() and any(c.isalpha() for c in response)


def capital_word_frequency(response: str, *, relation: str, capital_frequency: int) -> bool:
    caps = [w for w in _words(response) if w.isupper() and any(c.isalpha() for c in w)]
    return _compare(len(caps), relation, capital_frequency)


def start_with(response: str, *, phrase: str) -> bool:
    return response.strip().lower().startswith(phrase.strip().lower())


def end_with(response: str, *, end_phrase: str) -> bool:
    return response.strip().lower().endswith(end_phrase.strip().lower())


def wrapped_in_quotes(response: str) -> bool:
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def has_title(response: str) -> bool:
    """A title wrapped in double angular brackets, e.g. <<poem of joy>>."""
    return any(t.strip() for t in re.findall(r"<<([^\n]+?)>>", response))


def bullet_list(response: str, *, num_bullets: int) -> bool:
    bullets = re.findall(r"^\s*[*-]\s+\S", response, flags=re.M)
    return len(bullets) == num_bullets


def placeholders(response: str, *, num_placeholders: int) -> bool:
    return len(re.findall(r"\[[^\[\]\n]+\]", response)) >= num_placeholders


CONSTRAINTS: dict[str, Callable[..., bool]] = {
    "length:words": word_count,
    "length:sentences": sentence_count,
    "length:paragraphs": paragraph_count,
    "keywords:frequency": keyword_frequency,
    "keywords:existence": include_keywords,
    "keywords:forbidden_words": forbidden_words,
    "punctuation:forbidden_characters": forbidden_characters,
    "punctuation:no_comma": no_comma,
    "format:json": json_format,
    "case:lowercase": lowercase,
    "case:uppercase": uppercase,
    "case:capital_word_frequency": capital_word_frequency,
    "startend:start_with": start_with,
    "startend:end_with": end_with,
    "startend:quotation": wrapped_in_quotes,
    "format:title": has_title,
    "format:bullet_list": bullet_list,
    "format:placeholders": placeholders,
}


def check_constraint(response: str, instruction_id: str, kwargs: dict | None = None) -> bool:
    """Whether `response` follows one constraint; ValueError for unknown ids or bad arguments."""
    if instruction_id not in CONSTRAINTS:
        raise ValueError(f"unknown instruction id {instruction_id!r}; known ids: {sorted(CONSTRAINTS)}")
    # IFEval rows carry None for unused arguments; drop them so the signature check is meaningful.
    args = {k: v for k, v in (kwargs or {}).items() if v is not None}
    try:
        return bool(CONSTRAINTS[instruction_id](response, **args))
    except TypeError as exc:
        raise ValueError(f"bad arguments {args!r} for instruction {instruction_id!r}: {exc}") from exc


def instruction_score(response: str, ground_truth, *, strict: bool = False) -> dict:
    """Score dict: `score` = fraction followed (1/0 when strict) plus `ifeval/followed` count."""
    data = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    ids = list(data.get("instruction_id_list", []))
    kwargs = list(data.get("kwargs", [{}] * len(ids)))
    if not ids or len(ids) != len(kwargs):
        raise ValueError(
            "instruction ground truth needs a non-empty 'instruction_id_list' and a 'kwargs' list of the "
            f"same length (got {len(ids)} ids and {len(kwargs)} kwargs)"
        )
    followed = [check_constraint(response, i, k) for i, k in zip(ids, kwargs)]
    frac = sum(followed) / len(followed)
    score = float(all(followed)) if strict else frac
    return {"score": score, "ifeval/followed_frac": frac}
