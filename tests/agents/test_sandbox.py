"""The tool runner with a real worker process: every failure is an observation with its status."""

import textwrap
import time

import pytest

from rlframe.agents.calls import MalformedCall, ToolCall, parse_tool_calls
from rlframe.agents.sandbox import TRUNCATION_MARKER, ToolResult, ToolRunner, truncate
from rlframe.agents.tools import Tool, load_tools

TOOLS_FILE = '''
import os
import time

from rlframe.agents.tools import tool

NUM = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}
MB = {"type": "object", "properties": {"mb": {"type": "integer"}}, "required": ["mb"]}


@tool(name="sleep", description="Sleep.", parameters=NUM, timeout_s=0.3)
def sleep(seconds):
    time.sleep(seconds)
    return f"slept {seconds}"


@tool(name="alloc", description="Allocate at once.", parameters=MB, memory_mb=64)
def alloc(mb):
    return len(bytearray(mb * 2**20))


@tool(name="grow", description="Allocate bit by bit.", parameters=MB, memory_mb=64)
def grow(mb):
    chunks = [bytearray(2**20) for _ in range(mb)]
    return len(chunks)


@tool(name="fail", description="Raise.", parameters={"type": "object", "properties": {}})
def fail():
    return {}["missing"]


@tool(name="crash", description="Kill the worker.", parameters={"type": "object", "properties": {}})
def crash():
    os._exit(3)


@tool(name="pid", description="The pid of the call's process.", parameters={"type": "object", "properties": {}})
def pid():
    return os.getpid()


@tool(name="parent", description="The pid of the worker.", parameters={"type": "object", "properties": {}})
def parent():
    return os.getppid()


@tool(name="echo", description="Echo.", parameters={"type": "object", "properties": {"text": {"type": "string"}},
      "required": ["text"]})
def echo(text):
    return {"echo": text}
'''


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    f = tmp_path_factory.mktemp("tools") / "tools.py"
    f.write_text(TOOLS_FILE)
    r = ToolRunner(load_tools(str(f)), max_result_chars=120)
    yield r
    r.close()


def calc(expr):
    return ToolCall("calculator", {"expression": expr})


def test_ok_and_errors_in_one_batch(runner):
    calls = parse_tool_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>'
        '<tool_call>{"name": "fail", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}')
    results = runner.run(calls)
    assert results[0] == ToolResult("408", "ok")
    assert results[1] == ToolResult("error: ZeroDivisionError: division by zero", "error")
    assert results[2].status == "error" and results[2].text.startswith("error: UnsafeExpression: unsupported syntax Call")
    assert results[3] == ToolResult("error: KeyError: 'missing'", "error")
    assert results[4] == ToolResult('{"echo": "hi"}', "ok")
    assert results[5] == ToolResult("error: malformed tool call (unclosed <tool_call> tag (no </tool_call>))", "malformed")
    assert runner.run([]) == []


def test_unknown_tool_and_bad_arguments(runner):
    unknown, missing, wrong_type, extra = runner.run([
        ToolCall("search", {"q": "x"}), ToolCall("calculator", {}), ToolCall("calculator", {"expression": 12}),
        ToolCall("calculator", {"expression": "1", "precision": 3})])
    assert unknown.status == "unknown_tool" and unknown.text.startswith("error: unknown tool 'search' (tools: calculator, ")
    assert missing == ToolResult("error: bad arguments for calculator: missing required argument 'expression'",
                                 "bad_arguments")
    assert wrong_type == ToolResult("error: bad arguments for calculator: argument 'expression' must be a string, "
                                    "not an integer", "bad_arguments")
    assert extra.status == "bad_arguments" and "unexpected argument 'precision'" in extra.text


def test_malformed(runner):
    [r] = runner.run([MalformedCall(raw="{", reason="invalid JSON (Expecting value at char 1)")])
    assert r == ToolResult("error: malformed tool call (invalid JSON (Expecting value at char 1))", "malformed")


def test_results_are_truncated(runner):
    [r] = runner.run([ToolCall("echo", {"text": "x" * 1000})])
    assert r.status == "ok" and len(r.text) == 120 and r.text.endswith(TRUNCATION_MARKER)
    [r] = runner.run([ToolCall("echo", {"text": "x" * 106})])  # the JSON quotes make it 120 characters
    assert r.text == '{"echo": "' + "x" * 106 + '"}'
    [r] = runner.run([calc("1+" * 200 + ")")])  # errors are cut too (the message quotes the expression)
    assert r.status == "error" and len(r.text) == 120 and r.text.endswith(TRUNCATION_MARKER)
    assert truncate("abc", 3) == "abc" and truncate("abcdef", 4) == "abcd"


def test_memory_blow_up_is_an_error_and_the_worker_goes_on(runner):
    pid = runner.worker_pid
    small, huge, gradual, after = runner.run([ToolCall("alloc", {"mb": 8}), ToolCall("alloc", {"mb": 16_000}),
                                              ToolCall("grow", {"mb": 4_000}), calc("2+2")])
    assert small == ToolResult(str(8 * 2**20), "ok")
    assert huge == ToolResult("error: MemoryError: the call exceeded its memory limit of 64 MB", "error")
    assert gradual == huge
    assert after == ToolResult("4", "ok")
    assert runner.worker_pid == pid  # the limit is per call: the worker keeps running
    [again] = runner.run([ToolCall("alloc", {"mb": 32})])
    assert again.status == "ok"


def test_timeout_kills_the_call_and_the_worker_goes_on(runner):
    first, second = runner.run([ToolCall("pid", {}), ToolCall("pid", {})])
    assert first.text != second.text  # every call has a process of its own
    [worker] = runner.run([ToolCall("parent", {})])
    assert worker.text == str(runner.worker_pid)
    restarts = runner.restarts
    t0 = time.perf_counter()
    slow, fast = runner.run([ToolCall("sleep", {"seconds": 30}), ToolCall("sleep", {"seconds": 0.01})])
    assert time.perf_counter() - t0 < 5
    assert slow == ToolResult("error: timed out after 0.3 s", "timeout")
    assert 0.3 <= slow.seconds < 3
    assert fast == ToolResult("slept 0.01", "ok")
    assert runner.restarts == restarts  # the worker ended the call itself
    assert runner.run([ToolCall("parent", {})]) == [worker]
    assert runner.run([calc("6*7")]) == [ToolResult("42", "ok")]


def test_crash_of_the_worker_is_an_error(runner):
    crashed, after = runner.run([ToolCall("crash", {}), calc("1+1")])
    assert crashed == ToolResult("error: the tool's process exited with code 3 without a result", "error")
    assert after == ToolResult("2", "ok")


def test_counts_tally_statuses(runner):
    before = runner.counts.copy()
    runner.run([calc("1"), calc("x"), ToolCall("nope", {}), MalformedCall("", "r")])
    runner.run(parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>' * 3,
                                max_calls=2))
    diff = runner.counts - before
    assert diff == {"ok": 3, "error": 1, "unknown_tool": 1, "malformed": 1, "too_many_calls": 1}


def test_picklable_tool_without_file_and_close():
    import textwrap as tw

    shorten = Tool("shorten", "Shorten a text.", {"type": "object", "properties": {
        "text": {"type": "string"}, "width": {"type": "integer"}}, "required": ["text", "width"]}, tw.shorten)
    with ToolRunner({"shorten": shorten}, max_result_chars=100) as r:
        assert r.run([ToolCall("shorten", {"text": "a b c d e f", "width": 7})]) == [ToolResult("a [...]", "ok")]
    assert r.worker_pid is None
    r.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        r.run([])


def test_unpicklable_tool_is_refused_before_the_worker_starts():
    t = Tool("t", "d", {"type": "object", "properties": {}}, lambda: 1)
    with pytest.raises(ValueError, match="cannot be sent to the tool worker process.*agent.tools_path"):
        ToolRunner({"t": t})
