"""The chat format of the BPE tokenizer (`rlframe/data/bpe_tokenizer.py`): Qwen2.5-style turns with tools.

Every turn is `<|im_start|>{role}\\n{content}<|im_end|>\\n`. Tools are documented in the system turn
(`tool_system_prompt`, the same text the template writes when `tools=` is passed to
`apply_chat_template`). The assistant calls a tool by writing

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "47*382"}}
    </tool_call><|im_end|>

and the result comes back as a `tool` message, which the template renders, as Qwen2.5 does, inside
a user turn (consecutive tool messages share one user turn):

    <|im_start|>user
    <tool_response>
    17954
    </tool_response><|im_end|>

`add_generation_prompt=True` ends the text with `<|im_start|>assistant\\n`. The template only
appends: rendering a conversation and then one more message extends the earlier text, which the
agent loop relies on to cut out the tool turn's tokens
(`rlframe.controller.trainers.agent_loop.tool_turn_text`). An assistant message may carry its calls in
its content (raw text, as a policy generates it) or in `tool_calls` (OpenAI style, `{"name",
"arguments"}` or `{"function": {...}}`); both render the same text.
"""

from __future__ import annotations

import json

PAD = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
# Ids are the positions in this tuple. The first three are special tokens (skipped by
# `decode(..., skip_special_tokens=True)`); the tool tags are added tokens that are never split but
# stay in decoded text, as in Qwen2.5, so a verifier or parser sees where a call starts and ends.
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
TAG_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
ADDED_TOKENS = SPECIAL_TOKENS + TAG_TOKENS

DEFAULT_SYSTEM = "You are a helpful assistant."
# Qwen2.5's tool prompt, shortened (the tiny models read it in every sequence).
_TOOLS_HEADER = "\n\n# Tools\n\n<tools>"
_TOOLS_FOOTER = '\n</tools>\n\nCall a function with:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'



def _jinja_str(text: str) -> str:
    """A Python string as a jinja string literal (json escapes are valid jinja escapes)."""
    return json.dumps(text)


CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- " + _jinja_str(DEFAULT_SYSTEM) + " }}{%- endif %}"
    "{{- " + _jinja_str(_TOOLS_HEADER) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + _jinja_str(_TOOLS_FOOTER) + " }}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tool_system_prompt(tools: list[dict], system: str = DEFAULT_SYSTEM) -> str:
    """The system message content documenting `tools` (JSON-schema function specs), exactly as the
    chat template writes it when `tools=` is given; for datasets whose rows carry only messages."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return system + _TOOLS_HEADER + lines + _TOOLS_FOOTER


def format_tool_call(name: str, arguments: dict) -> str:
    """The text of one tool call as the assistant writes it (the content of its turn)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"
