"""Tool calls parsed out of generated text (the Qwen2.5 / Hermes format):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

Whitespace around the JSON is optional and a turn may hold several calls; text outside the tags is
ignored. Every opening tag yields exactly one entry, in order: a `ToolCall` when its body is a JSON
object with a string "name" and an object "arguments", else a `MalformedCall` with the raw text and
the reason (unclosed tag, invalid JSON, not an object, missing name, arguments not an object), which
the runner turns into an observation so the policy learns what went wrong. A missing "arguments" is
read as {} (a call of a tool without parameters); "arguments" given as a string holding a JSON
object (the OpenAI API's encoding) is decoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedCall:
    raw: str  # the text after the opening tag (up to the closing tag when there is one)
    reason: str


def parse_tool_call(body: str) -> ToolCall | MalformedCall:
    """One call from the text between the tags."""
    text = body.strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return MalformedCall(raw=body, reason=f"invalid JSON ({exc.msg} at char {exc.pos})")
    except RecursionError:
        return MalformedCall(raw=body, reason="invalid JSON (nested too deeply)")
    if not isinstance(obj, dict):
        return MalformedCall(raw=body, reason=f"the call is a JSON {_json_type(obj)}, not an object with \"name\" and \"arguments\"")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return MalformedCall(raw=body, reason='missing "name" (the tool name as a string)')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            decoded = None
        if isinstance(decoded, dict):
            args = decoded
    if not isinstance(args, dict):
        return MalformedCall(raw=body, reason=f'"arguments" is a JSON {_json_type(args)}, not an object')
    return ToolCall(name=name.strip(), arguments=args)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """The tool calls of a generated turn, in order; [] when it has none."""
    out: list[ToolCall | MalformedCall] = []
    pos = text.find(TOOL_CALL_START)
    while pos >= 0:
        body_start = pos + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        nxt = text.find(TOOL_CALL_START, body_start)
        if end < 0 or 0 <= nxt < end:  # no closing tag before the text ends or the next call starts
            stop = len(text) if nxt < 0 else nxt
            out.append(MalformedCall(raw=text[body_start:stop], reason=f"unclosed {TOOL_CALL_START} tag (no {TOOL_CALL_END})"))
            pos = nxt
            continue
        out.append(parse_tool_call(text[body_start:end]))
        pos = text.find(TOOL_CALL_START, end + len(TOOL_CALL_END))
    return out


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)
