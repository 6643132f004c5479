from rlframe.agents.calls import MalformedCall, ToolCall, parse_tool_calls


def test_one_call_qwen_format():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "12*34"})]


def test_whitespace_optional_and_text_outside_ignored():
    text = 'a<tool_call>{"name":"calculator","arguments":{"expression":"1+1"}}</tool_call>b </tool_call> c'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+1"})]
    assert parse_tool_calls("no calls here, not even </tool_call>") == []
    assert parse_tool_calls("") == []


def test_several_calls_in_order():
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\nthen\n'
            '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call>'
            '<tool_call> {"name": "c"} </tool_call>')
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]}), ToolCall("c", {})]


def test_arguments_as_json_string_are_decoded():
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1})]


def _reasons(text):
    out = parse_tool_calls(text)
    assert all(isinstance(c, MalformedCall) for c in out), out
    return [c.reason for c in out]


def test_malformed_calls_each_give_their_reason():
    [r] = _reasons('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}')
    assert r.startswith("unclosed <tool_call>")
    [r] = _reasons('<tool_call>{"name": "calculator", arguments: {}}</tool_call>')
    assert r.startswith("invalid JSON")
    [r] = _reasons('<tool_call>{"arguments": {"expression": "1"}}</tool_call>')
    assert 'missing "name"' in r
    [r] = _reasons('<tool_call>{"name": "", "arguments": {}}</tool_call>')
    assert 'missing "name"' in r
    [r] = _reasons('<tool_call>{"name": "calculator", "arguments": ["1+1"]}</tool_call>')
    assert r == '"arguments" is a JSON array, not an object'
    [r] = _reasons('<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>')
    assert r == '"arguments" is a JSON string, not an object'
    [r] = _reasons("<tool_call>[1, 2]</tool_call>")
    assert "JSON array, not an object" in r


def test_malformed_and_valid_calls_mix_in_order():
    text = ('<tool_call>{"name": "a"}'  # never closed: the next call starts first
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
            '<tool_call>{oops}</tool_call>')
    out = parse_tool_calls(text)
    assert isinstance(out[0], MalformedCall) and out[0].raw == '{"name": "a"}' and "unclosed" in out[0].reason
    assert out[1] == ToolCall("b", {})
    assert isinstance(out[2], MalformedCall) and out[2].raw == "{oops}"
