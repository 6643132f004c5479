import json

import pytest

from rlframe.data.dataset import PromptDataset
from rlframe.data.synthetic import ArithmeticSpec, arithmetic_rows, write_parquet
from rlframe.data.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _row(content, gt="1", **over):
    row = {"prompt": [{"role": "user", "content": content}], "data_source": "arithmetic",
           "reward_model": {"ground_truth": gt, "style": "rule"}, "extra_info": {"k": 1}}
    row.update(over)
    return row


def test_parquet_rows_are_tokenized_with_the_chat_template(tmp_path, tok):
    rows = arithmetic_rows(num_train=20, num_test=0, spec=ArithmeticSpec(), seed=0)["train"]
    path = write_parquet(rows, tmp_path / "train.parquet")
    ds = PromptDataset(path, tokenizer=tok, max_prompt_length=8)
    assert len(ds) == 20 and ds.skipped.total == 0
    first = ds[0]
    assert tok.decode(first.prompt_ids) == rows[0]["prompt"][0]["content"]
    assert first.ground_truth == rows[0]["reward_model"]["ground_truth"]
    assert first.extra_info["index"] == 0 and first.raw_prompt == rows[0]["prompt"]


def test_bad_rows_are_skipped_counted_and_located(tmp_path, tok):
    lines = [
        json.dumps(_row("1+1=")),                        # 0 ok
        "{not json",                                      # 1 malformed
        json.dumps(_row("   ")),                          # 2 empty
        json.dumps(_row("9" * 40)),                       # 3 too long
        json.dumps({"prompt": "2+2=", "data_source": 5}),  # 4 malformed (types)
        json.dumps(_row("2+2=", prompt=[])),              # 5 empty... no message at all
        json.dumps(_row("3+3=")),                         # 6 ok
        json.dumps({k: v for k, v in _row("4+4=").items() if k != "reward_model"}),  # 7 malformed
        json.dumps(_row("x", prompt=[{"role": "user"}])),  # 8 malformed (no content)
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    ds = PromptDataset([path], tokenizer=tok, max_prompt_length=10)
    assert [tok.decode(r.prompt_ids) for r in ds.rows] == ["1+1=", "3+3="]
    assert ds.skipped.counts == {"malformed": 4, "empty": 2, "too_long": 1}
    assert [r for _, r in ds.skipped.first_rows["malformed"]] == [1, 4, 7, 8]
    assert [r for _, r in ds.skipped.first_rows["empty"]] == [2, 5]
    assert "too_long=1 (first rows: mixed.jsonl:3)" in ds.skipped.summary()


def test_file_without_usable_rows_names_the_file(tmp_path, tok):
    good = write_parquet([_row("1+1=")], tmp_path / "good.parquet")
    bad = write_parquet([_row("9" * 50)], tmp_path / "all_long.parquet")
    with pytest.raises(ValueError, match="all_long.parquet.*no usable rows.*too_long=1"):
        PromptDataset([good, bad], tokenizer=tok, max_prompt_length=10)
    with pytest.raises(ValueError, match="does not exist"):
        PromptDataset(tmp_path / "absent.parquet", tokenizer=tok, max_prompt_length=10)
    with pytest.raises(ValueError, match="suffix"):
        (tmp_path / "x.csv").write_text("a\n")
        PromptDataset(tmp_path / "x.csv", tokenizer=tok, max_prompt_length=10)


def test_jsonl_line_that_is_not_utf8_is_skipped_and_counted(tmp_path, tok):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(_row("1+1=")).encode() + b"\n"
                     + b'{"prompt": "\xff\xfe bad bytes", "data_source": "x"}\n'   # 1: not UTF-8
                     + json.dumps(_row("2+2=")).encode() + b"\n")
    ds = PromptDataset(path, tokenizer=tok, max_prompt_length=10)
    assert [tok.decode(r.prompt_ids) for r in ds.rows] == ["1+1=", "2+2="]
    assert ds.skipped.counts["malformed"] == 1
    assert [r for _, r in ds.skipped.first_rows["malformed"]] == [1]


def test_parquet_with_wrong_schema_rows_are_malformed_and_the_file_is_named(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = write_parquet([_row("1+1="), _row("2+2=")], tmp_path / "good.parquet")
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"question": ["1+1=", "3+3="], "answer": [2, 6]}), wrong)
    typed = tmp_path / "typed.parquet"  # the right columns with the wrong types
    pq.write_table(pa.table({"prompt": [1, 2], "data_source": ["a", "b"], "reward_model": ["2", "4"]}), typed)
    for bad, note in ((wrong, "schema lacks columns ['prompt', 'data_source', 'reward_model']"), (typed, "malformed=2")):
        with pytest.raises(ValueError, match="no usable rows") as err:
            PromptDataset([good, bad], tokenizer=tok, max_prompt_length=10)
        assert bad.name in str(err.value) and "malformed=2" in str(err.value) and note in str(err.value)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not a parquet file at all")
    with pytest.raises(ValueError, match="corrupt.parquet' cannot be read as parquet"):
        PromptDataset([good, corrupt], tokenizer=tok, max_prompt_length=10)
