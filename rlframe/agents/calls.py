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
object (the OpenAI API's encoding) is decoded. With `max_calls` (agent.max_calls_per_turn), the
calls after the first `max_calls` of a turn become `ExcessCall`s: not run, answered with an error.

Results go back into the chat as text, and the text comes from a tool (or echoes the policy: an
unknown tool's name). `neutralize_control_tokens` breaks every spelled-out control token in it (the
tokenizer's special and added tokens: `<|im_end|>`, `<tool_call>`, ...) with a zero-width space
after its first character, so that the observation's tokens never hold a control token the text
merely spelled out (the policy would read a turn ending or a tool call that nobody made);
`check_neutralized` proves that on a given tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
ZERO_WIDTH_SPACE = "\u200b"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedCall:
    raw: str  # the text after the opening tag (up to the closing tag when there is one)
    reason: str


@dataclass(frozen=True)
class ExcessCall:
    """A call past the turn's cap (agent.max_calls_per_turn): not run; the runner answers it with an error."""
    call: ToolCall | MalformedCall
    limit: int  # the cap: how many calls of the turn ran


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


def parse_tool_calls(text: str, *, max_calls: int | None = None) -> list[ToolCall | MalformedCall | ExcessCall]:
    """The tool calls of a generated turn, in order; [] when it has none. Past `max_calls` (None: no
    cap), each call is an `ExcessCall`."""
    out: list = []
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
    if max_calls is not None and len(out) > max_calls:
        out[max_calls:] = [ExcessCall(call=c, limit=max_calls) for c in out[max_calls:]]
    return out


def control_token_texts(tokenizer) -> tuple[str, ...]:
    """The texts a (transformers) tokenizer reads as one special or added token, longest first;
    those of a single character or only whitespace are left out (they cannot be broken up)."""
    texts = {getattr(tok, "content", str(tok)) for tok in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    texts.update(getattr(tokenizer, "all_special_tokens", None) or ())
    keep = (t for t in texts if isinstance(t, str) and len(t) > 1 and t.strip() and ZERO_WIDTH_SPACE not in t)
    return tuple(sorted(keep, key=lambda t: (-len(t), t)))


@lru_cache(maxsize=16)
def _control_pattern(texts: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(map(re.escape, texts)))


def _break(match: re.Match) -> str:
    token = match.group(0)
    return token[0] + ZERO_WIDTH_SPACE + token[1:]


def neutralize_control_tokens(text: str, texts: tuple[str, ...]) -> str:
    """`text` with each occurrence of a control token text (`control_token_texts`) broken by a
    zero-width space after its first character, repeated until none is left (breaking one can leave
    an overlapping one whole)."""
    if not texts:
        return text
    pattern = _control_pattern(texts)
    while pattern.search(text):
        text = pattern.sub(_break, text)
    return text


def check_neutralized(tokenizer) -> None:
    """ValueError when a neutralized control token text still encodes to that token on `tokenizer` (a
    normalizer that drops zero-width spaces before matching added tokens would do that). A token that
    the zero-width space itself encodes to (a character tokenizer's <unk>) does not count."""
    texts = control_token_texts(tokenizer)
    escape = set(tokenizer.encode(ZERO_WIDTH_SPACE, add_special_tokens=False))
    leaked = [t for t in texts if (i := tokenizer.convert_tokens_to_ids(t)) not in escape
              and i in tokenizer.encode(neutralize_control_tokens(t, texts), add_special_tokens=False)]
    if leaked:
        raise ValueError(f"tool results cannot be kept from spelling control tokens on this tokenizer: {leaked} with "
                         "a zero-width space inside still encode to those tokens (its added tokens are matched "
                         "after a normalizer that drops such spaces); mark the added tokens normalized=False in "
                         "tokenizer.json")


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)
