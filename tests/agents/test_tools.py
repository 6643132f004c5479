import textwrap

import pytest

from rlframe.agents.tools import BUILTIN_TOOLS, Tool, check_arguments, load_tools, tool, tool_schemas

OBJ = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}


def _file(tmp_path, source, name="my_tools.py"):
    f = tmp_path / name
    f.write_text(textwrap.dedent(source))
    return f


def test_builtins_only():
    tools = load_tools(None)
    assert list(tools) == ["calculator"]
    assert tools["calculator"].fn(expression="6*7") == "42"
    assert load_tools(None, builtin=()) == {}


def test_user_file_with_tools_list_and_decorator(tmp_path):
    f = _file(tmp_path, '''
        from rlframe.agents.tools import Tool, tool

        def upper(word):
            return word.upper()

        TOOLS = [Tool(name="upper", description="Upper-case a word.", parameters={
            "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}, fn=upper)]

        @tool(name="count", parameters={"type": "object", "properties": {"text": {"type": "string"},
              "min_len": {"type": "integer"}}, "required": ["text"]}, timeout_s=1.5, memory_mb=64)
        def count_words(text, min_len=0):
            """Count the words of a text."""
            return sum(len(w) >= min_len for w in text.split())
    ''')
    tools = load_tools(str(f))
    assert list(tools) == ["calculator", "upper", "count"]
    assert tools["upper"].fn(word="ab") == "AB"
    count = tools["count"]
    assert (count.description, count.timeout_s, count.memory_mb) == ("Count the words of a text.", 1.5, 64)
    assert count.fn(text="a bb ccc", min_len=2) == 2  # the decorated function stays a plain function
    assert count.source == str(f.resolve()) and tools["calculator"].source == "builtin"
    specs = tool_schemas(tools)
    assert [s["type"] for s in specs] == ["function"] * 3
    assert specs[0]["function"] == {"name": "calculator", "description": BUILTIN_TOOLS["calculator"].description,
                                    "parameters": BUILTIN_TOOLS["calculator"].parameters}
    assert specs[2]["function"]["parameters"]["required"] == ["text"]
    specs[0]["function"]["parameters"]["required"].append("x")  # copies: the registry is not changed
    assert BUILTIN_TOOLS["calculator"].parameters["required"] == ["expression"]


def test_calculator_schema():
    assert BUILTIN_TOOLS["calculator"].parameters["properties"]["expression"]["type"] == "string"
    assert BUILTIN_TOOLS["calculator"].parameters["required"] == ["expression"]


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*fix agent.tools_path"):
        load_tools(str(tmp_path / "absent.py"))


def test_no_tools_found(tmp_path):
    f = _file(tmp_path, "def helper(x):\n    return x\n")
    with pytest.raises(ValueError, match=r"defines no tools \(functions there: \['helper'\]\).*TOOLS = \[Tool"):
        load_tools(str(f))


def test_import_error_is_reported(tmp_path):
    f = _file(tmp_path, "import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match="importing tools file .* failed.*not_a_module_anywhere"):
        load_tools(str(f))


def test_duplicate_with_builtin(tmp_path):
    f = _file(tmp_path, f'''
        from rlframe.agents.tools import tool
        @tool(name="calculator", description="mine", parameters={{"type": "object", "properties": {{}}}})
        def calc():
            return "0"
    ''')
    with pytest.raises(ValueError, match="duplicate tool name 'calculator'.*built-in.*agent.builtin_tools"):
        load_tools(str(f))
    assert list(load_tools(str(f), builtin=())) == ["calculator"]


def test_duplicate_within_file(tmp_path):
    f = _file(tmp_path, f'''
        from rlframe.agents.tools import Tool
        def a(word): return word
        def b(word): return word
        TOOLS = [Tool("same", "a", {OBJ!r}, a), Tool("same", "b", {OBJ!r}, b)]
    ''')
    with pytest.raises(ValueError, match="duplicate tool name 'same'.*rename one"):
        load_tools(str(f))


def test_unknown_builtin():
    with pytest.raises(ValueError, match=r"no built-in tool 'search'.*\['calculator'\].*agent.builtin_tools"):
        load_tools(None, builtin=("search",))


@pytest.mark.parametrize("schema,msg", [
    ({"type": "string"}, "must be a JSON schema object"),
    (None, "must be a JSON schema object"),
    ({"properties": {"word": {"type": "string"}}}, "must be a JSON schema object"),
    ({"type": "object", "properties": {"word": {"type": "text"}}}, "type 'text'"),
    ({"type": "object", "properties": {"word": {"type": "string"}}, "required": ["wrod"]}, r"required names \['wrod'\]"),
    ({"type": "object", "properties": ["word"]}, "properties must be a dict"),
    ({"type": "object", "properties": {"word": "string"}}, r"parameters.properties.word must be a JSON schema"),
])
def test_bad_schema(tmp_path, schema, msg):
    f = _file(tmp_path, f'''
        from rlframe.agents.tools import Tool
        def f(word=None): return word
        TOOLS = [Tool("t", "d", {schema!r}, f)]
    ''')
    with pytest.raises(ValueError, match=msg):
        load_tools(str(f))


@pytest.mark.parametrize("entry,msg", [
    ('Tool("t", "d", SCHEMA, 3)', "fn is a int, not callable"),
    ('Tool("t", "d", SCHEMA, lambda other: 1)', r"called as fn\(\*\*arguments\).*rename the parameters"),
    ('Tool("t", "d", SCHEMA, lambda word, extra: 1)', r"requires the parameters \['extra'\]"),
    ('Tool("bad name!", "d", SCHEMA, lambda word: 1)', "not a valid tool name"),
    ('Tool("t", "d", SCHEMA, lambda word: 1, timeout_s=0)', "timeout_s must be a positive number"),
    ('Tool("t", "d", SCHEMA, lambda word: 1, memory_mb=0.5)', "memory_mb must be a positive int"),
    ('"calculator"', r"TOOLS\[0\] .* is a str, not a rlframe.agents.tools.Tool"),
])
def test_bad_tool(tmp_path, entry, msg):
    f = _file(tmp_path, f'''
        from rlframe.agents.tools import Tool
        SCHEMA = {OBJ!r}
        TOOLS = [{entry}]
    ''')
    with pytest.raises(ValueError, match=msg):
        load_tools(str(f))


def test_tools_not_a_list(tmp_path):
    f = _file(tmp_path, "TOOLS = 'calculator'\n")
    with pytest.raises(ValueError, match="TOOLS in tools file .* is a str; it must be a list"):
        load_tools(str(f))


def test_decorator_defaults():
    @tool(parameters=OBJ)
    def shout(word):
        """Shout a word.

        More text."""
        return word + "!"

    assert shout("hi") == "hi!"
    spec = shout.__rlframe_tool__
    assert (spec.name, spec.description.splitlines()[0], spec.timeout_s, spec.memory_mb) == ("shout", "Shout a word.", 2.0, 256)


def test_check_arguments():
    t = Tool("t", "d", {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
        "mode": {"type": "string", "enum": ["fast", "slow"]}, "xs": {"type": "array", "items": {"type": "integer"}},
        "o": {"type": "object", "properties": {"k": {"type": ["string", "null"]}}, "required": ["k"]}},
        "required": ["s"]}, lambda **kw: 0)
    ok = {"s": "a", "n": 3, "x": 1.5, "b": True, "mode": "fast", "xs": [1, 2], "o": {"k": None, "extra": 1}}
    assert check_arguments(t, ok) is None
    assert check_arguments(t, {"s": "a", "n": 2.0, "x": 2}) is None  # 2.0 is an integer in JSON schema
    cases = [
        ({}, "missing required argument 's'"),
        ({"s": 1}, "argument 's' must be a string, not an integer"),
        ({"s": "a", "n": True}, "argument 'n' must be an integer, not a boolean"),
        ({"s": "a", "n": 1.5}, "argument 'n' must be an integer, not a number"),
        ({"s": "a", "x": "1"}, "argument 'x' must be a number, not a string"),
        ({"s": "a", "mode": "medium"}, "argument 'mode' must be one of ['fast', 'slow'], not 'medium'"),
        ({"s": "a", "xs": [1, "2"]}, "argument 'xs[1]' must be an integer, not a string"),
        ({"s": "a", "o": {}}, "missing required argument 'o.k'"),
        ({"s": "a", "o": {"k": 3}}, "argument 'o.k' must be a string or null, not an integer"),
        ({"s": "a", "zzz": 1}, "unexpected argument 'zzz' (arguments: s, n, x, b, mode, xs, o)"),
        ([1], "arguments must be a JSON object, not an array"),
    ]
    for args, msg in cases:
        assert check_arguments(t, args) == msg, args
