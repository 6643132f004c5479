from rlframe.rewards.registry import default_compute_score
from rlframe.rewards.verifiers import extract_tagged_answer, tool_arithmetic_score

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47*382"}}\n</tool_call>'


def test_answer_after_tool_calls():
    assert tool_arithmetic_score(CALL + "<answer>17954</answer>", "17954") == 1.0
    assert tool_arithmetic_score(CALL + "<answer> 17,954 </answer>", "17954") == 1.0
    assert tool_arithmetic_score(CALL + "<answer>17953</answer>", "17954") == 0.0
    # The policy's text as the trainer decodes it: tool tags kept, tool results absent.
    two = CALL + "<answer>1</answer>" + CALL + "<answer>17954</answer>"
    assert tool_arithmetic_score(two, "17954") == 1.0 and extract_tagged_answer(two) == "17954"


def test_answer_without_tool_calls_and_unanswered():
    assert tool_arithmetic_score("<answer>17954</answer>", "17954") == 1.0
    assert tool_arithmetic_score("The answer is <answer>17954</answer>.", "17954") == 1.0
    assert tool_arithmetic_score("17954", "17954") == 0.0  # no tag
    assert tool_arithmetic_score(CALL, "17954") == 0.0  # a call without an answer
    assert tool_arithmetic_score('<tool_call>\n{"name": "calculator", "arguments": {"expression": "17954"}}\n</tool_call>', "17954") == 0.0
    assert tool_arithmetic_score("<answer>17954 or 3</answer>", "17954") == 0.0
    assert default_compute_score("tool_arithmetic", CALL + "<answer>17954</answer>", "17954") == 1.0
