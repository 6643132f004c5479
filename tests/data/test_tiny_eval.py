from rlframe.data.tokenizer import build_char_tokenizer


def test_correctness_needs_the_answer_then_eos():
    from rlframe.data.tiny_eval import is_correct

    tok = build_char_tokenizer()
    ids = tok.encode("81", add_special_tokens=False)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert is_correct(tok, ids + [eos, pad], "81") == (True, True)
    assert is_correct(tok, ids + [eos], "18") == (False, True)
    assert is_correct(tok, ids + ids, "81") == (False, False)  # no EOS within the budget
    assert is_correct(tok, ids + tok.encode("1", add_special_tokens=False) + [eos], "81") == (False, True)
