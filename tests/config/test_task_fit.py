"""config/task_fit.py's numbers are the data's: the tool task's prompts are tool_task.PROMPT_TOKENS
tokens with the shipped agent preset's tokenizer, so data.prompt_length=PROMPT_TOKENS keeps every
row and one less keeps none (what the validation refuses instead of the dataset's "no usable rows")."""

from rlframe.data.dataset import encode_prompt
from rlframe.data.pretrain import default_sft
from rlframe.data.shipped import PRESETS_DIR
from rlframe.data.tool_task import PROMPT_TOKENS, tool_rows


def test_tool_task_prompts_are_prompt_tokens_long():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(PRESETS_DIR / "agent"))
    split = default_sft("tool_arithmetic")
    rows = tool_rows(num_train=split.num_train, num_test=split.num_test)
    lengths = {len(encode_prompt(tokenizer, row["prompt"])) for rows_ in rows.values() for row in rows_}
    assert max(lengths) == PROMPT_TOKENS, sorted(lengths)
    assert min(lengths) == PROMPT_TOKENS, sorted(lengths)  # so one less than PROMPT_TOKENS keeps no row
