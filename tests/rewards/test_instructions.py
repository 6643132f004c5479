import json

import pytest

from rlframe.rewards.instructions import CONSTRAINTS, check_constraint, instruction_score

# (instruction id, kwargs, a response that follows it, a response that does not)
CASES = [
    ("length:words", {"relation": "at most", "num_words": 3}, "one two three", "one two three four"),
    ("length:words", {"relation": "at least", "num_words": 2}, "it's fine", "fine"),
    ("length:sentences", {"relation": "exactly", "num_sentences": 2}, "Hi there. Bye now!", "One. Two. Three."),
    ("length:paragraphs", {"num_paragraphs": 2}, "para one\n***\npara two", "just one"),
    ("keywords:frequency", {"keyword": "cat", "relation": "at least", "frequency": 2}, "Cat and cat.", "a cat, catalog"),
    ("keywords:existence", {"keywords": ["red", "blue"]}, "red and blue", "red and green"),
    ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "good badge", "a bad day"),
    ("punctuation:forbidden_characters", {"characters": "!?"}, "calm.", "wow!"),
    ("punctuation:no_comma", {}, "no commas here", "one, two"),
    ("format:json", {}, '```json\n{"a": 1}\n```', "{a: 1}"),
    ("format:json", {}, '[1, 2]', "plain text"),
    ("case:lowercase", {}, "all lower 123", "Not lower"),
    ("case:uppercase", {}, "ALL UPPER!", "ALL upper"),
    ("case:capital_word_frequency", {"relation": "less than", "capital_frequency": 2}, "ONE word", "TWO WORDS"),
    ("startend:start_with", {"phrase": "Dear Sir"}, "dear sir, hello", "Hello, dear sir"),
    ("startend:end_with", {"end_phrase": "Any questions?"}, "Done. Any questions?", "Any questions? Done."),
    ("startend:quotation", {}, '"quoted"', 'not "quoted"'),
    ("format:title", {}, "<<My Title>>\nbody", "My Title\nbody"),
    ("format:bullet_list", {"num_bullets": 2}, "* a\n* b", "* a\n* b\n* c"),
    ("format:placeholders", {"num_placeholders": 2}, "at [address] on [date]", "at [address]"),
]


@pytest.mark.parametrize("iid, kwargs, good, bad", CASES)
def test_constraint_follows_and_violates(iid, kwargs, good, bad):
    assert check_constraint(good, iid, kwargs) is True
    assert check_constraint(bad, iid, kwargs) is False


def test_every_registered_constraint_is_covered():
    assert {c[0] for c in CASES} == set(CONSTRAINTS)
    assert len(CONSTRAINTS) >= 10


def test_instruction_score_fraction_and_strict():
    gt = json.dumps({"instruction_id_list": ["case:lowercase", "punctuation:no_comma"], "kwargs": [{}, {}]})
    assert instruction_score("hello, world", gt) == {"score": 0.5, "ifeval/followed_frac": 0.5}
    assert instruction_score("hello, world", gt, strict=True)["score"] == 0.0
    assert instruction_score("hello world", gt, strict=True)["score"] == 1.0


def test_ifeval_style_none_kwargs_are_ignored():
    assert check_constraint("abc", "case:lowercase", {"num_words": None})


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown instruction id"):
        check_constraint("x", "no:such")
    with pytest.raises(ValueError, match="bad arguments"):
        check_constraint("x", "length:words", {"num": 3})
    with pytest.raises(ValueError, match="unknown relation"):
        check_constraint("x", "length:words", {"relation": "around", "num_words": 3})
    with pytest.raises(ValueError, match="same length"):
        instruction_score("x", {"instruction_id_list": ["case:lowercase"], "kwargs": []})
