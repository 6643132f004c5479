from rlframe.data.chat_format import tool_system_prompt
from rlframe.data.tool_task import CALCULATOR, SYSTEM, calculator, conversation, sft_conversations, tool_rows, ToolArithmeticSpec


def test_rows_are_disjoint_and_in_the_verl_layout():
    rows = tool_rows(num_train=300, num_test=50, seed=0)
    assert len(rows["train"]) == 300 and len(rows["test"]) == 50
    train = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows["train"]}
    assert not train & {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows["test"]}
    row = rows["test"][0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert 10 <= a <= 99 and 100 <= b <= 999 and row["reward_model"]["ground_truth"] == str(a * b)
    assert row["data_source"] == "tool_arithmetic" and row["extra_info"]["expression"] == f"{a}*{b}"
    assert row["prompt"] == [{"role": "system", "content": tool_system_prompt([CALCULATOR], SYSTEM)},
                             {"role": "user", "content": f"What is {a}*{b}?"}]
    assert tool_rows(num_train=300, num_test=50, seed=0) == rows


def test_calculator_and_transcripts():
    assert calculator("47*382") == "17954" and calculator("7/2") == "3.5" and calculator("(1+2)*3") == "9"
    assert calculator("__import__('os')").startswith("error:")
    assert [m["role"] for m in conversation(1, 2, use_tool=True)] == ["system", "user", "assistant", "tool", "assistant"]
    assert [m["role"] for m in conversation(1, 2, use_tool=False)] == ["system", "user", "assistant"]
    rows = tool_rows(num_train=600, num_test=0, seed=0)["train"]
    convs = sft_conversations(rows, spec=ToolArithmeticSpec(), seed=0)
    low = [len(c) == 5 for r, c in zip(rows, convs) if r["extra_info"]["a"] < 55]
    high = [len(c) == 5 for r, c in zip(rows, convs) if r["extra_info"]["a"] >= 55]
    assert 0.1 < sum(low) / len(low) < 0.3 and 0.7 < sum(high) / len(high) < 0.9  # direct_low 0.8, direct_high 0.2
