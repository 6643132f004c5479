"""Token-exact capture of what an agent's requests generated (the OpenAI endpoint, openai_endpoint.py).

An episode is one conversation, named by its id (the `X-Episode-Id` header or the request's `user`
field). Its first request's messages are rendered by the tokenizer's chat template and encoded: that
is the episode's prompt. Every completion is recorded as the tokens the engine sampled and their
log-probs. A later request of the episode must repeat the conversation so far, as the endpoint
returned it, and may add messages (tool results, user turns) after it: only those are rendered and
encoded (the template's text after the last recorded turn's end-of-turn token), so earlier turns are
never re-tokenized. A request that changes an earlier message, or adds an assistant message the
endpoint did not generate, is refused with the offending message.

The episode's record, one training row:
    prompt      the first request's prompt tokens
    tokens      everything after it: the model's turns and what the environment added, in order
    mask        1 on the tokens the model sampled, 0 on the environment's (and the template's)
    log_probs   the engine's log-probs of the sampled tokens (0 elsewhere)
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request the endpoint refuses: answered with an OpenAI-style error (status, message, param, code)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind


def normalize_message(msg, index: int) -> dict:
    """An OpenAI chat message as the template reads it: role, content (text parts joined), and
    tool_calls / tool_call_id / name where given. Refuses what the endpoint cannot render."""
    if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "tool"):
        raise RequestError(f"messages[{index}] must be an object with role system, user, assistant or tool; got "
                           f"{json.dumps(msg)[:200]}", param=f"messages[{index}]")
    content = msg.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"messages[{index}].content: only text parts are supported (no images or audio)",
                               param=f"messages[{index}].content")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RequestError(f"messages[{index}].content must be a string or a list of text parts",
                           param=f"messages[{index}].content")
    out = {"role": msg["role"], "content": content}
    if msg["role"] == "assistant" and msg.get("tool_calls"):
        calls = []
        for k, call in enumerate(msg["tool_calls"]):
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"messages[{index}].tool_calls[{k}] must have a function with a name",
                                   param=f"messages[{index}].tool_calls")
            args = fn.get("arguments", "{}")
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": args if isinstance(args, str)
                                       else json.dumps(args)}})
        out["tool_calls"] = calls
    if msg["role"] == "tool" and msg.get("tool_call_id") is not None:
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def _same(a: dict, b: dict) -> bool:
    """Whether a repeated message is the one recorded (tool call arguments compared as JSON values)."""
    if a["role"] != b["role"] or a["content"] != b["content"] or a.get("tool_call_id") != b.get("tool_call_id"):
        return False
    ca, cb = a.get("tool_calls") or [], b.get("tool_calls") or []
    if len(ca) != len(cb):
        return False
    for x, y in zip(ca, cb):
        if x["function"]["name"] != y["function"]["name"] or x.get("id") != y.get("id"):
            return False
        try:
            if json.loads(x["function"]["arguments"]) != json.loads(y["function"]["arguments"]):
                return False
        except json.JSONDecodeError:
            if x["function"]["arguments"] != y["function"]["arguments"]:
                return False
    return True


@dataclass
class Episode:
    id: str
    tools: list | None = None
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation so far, the last turn as returned
    ended_with_eos: bool = True  # the last turn ended with an end-of-turn token (else cut at max_tokens)
    turns: int = 0
    busy: bool = False  # a request of it is being generated: another one at once is refused

    def context(self) -> list[int]:
        return self.prompt + self.tokens


class EpisodeStore:
    """Every episode of a rollout step, by id (thread-safe: the endpoint's requests arrive concurrently)."""

    def __init__(self, tokenizer, *, eos_text: str):
        from rlframe.agents.calls import control_token_texts

        self.tokenizer, self.eos_text = tokenizer, eos_text
        self._controls = control_token_texts(tokenizer)
        self._episodes: dict[str, Episode] = {}
        self._retired: set[str] = set()  # ids of episodes already taken (pop_all): their requests are refused
        self._lock = threading.Lock()

    def get(self, episode_id: str) -> Episode | None:
        with self._lock:
            return self._episodes.get(episode_id)

    def pop_all(self) -> dict[str, Episode]:
        with self._lock:
            out, self._episodes = self._episodes, {}
            self._retired.update(out)
        return out

    def _neutralized(self, messages: list[dict]) -> list[dict]:
        """Tool results with every spelled-out control token broken up (calls.py), as the in-process agent
        loop does: a result that writes `<|im_end|>` stays text. System and user messages are the prompt's
        author's and are encoded as the dataset encodes them (a system turn may document `<tool_call>`)."""
        from rlframe.agents.calls import neutralize_control_tokens

        return [{**m, "content": neutralize_control_tokens(m["content"], self._controls)} if m["role"] == "tool" else m
                for m in messages]

    def _render(self, messages: list[dict], tools, *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja errors: the template cannot render this conversation
            raise RequestError(f"the model's chat template cannot render these messages: {err}",
                               param="messages") from err

    def begin(self, episode_id: str, messages: list[dict], tools) -> tuple[Episode, list[int], list[int]]:
        """The episode a request continues (or starts), marked busy, with the ids of what the request
        adds after its recorded tokens and the whole context to generate from."""
        with self._lock:
            ep = self._episodes.get(episode_id)
            if episode_id in self._retired:
                raise RequestError(f"episode {episode_id!r} has ended (its trajectory was taken for training)",
                                   status=410, code="episode_ended")
            if ep is None:
                ep = self._episodes[episode_id] = Episode(episode_id, tools=tools)
            elif ep.busy:
                raise RequestError(f"episode {episode_id!r} has a request in flight; an episode's turns come one "
                                   "after another", code="episode_busy", status=409)
            ep.busy = True
        try:
            added = self._added_ids(ep, messages, tools)
        except Exception:
            ep.busy = False
            raise
        return ep, added, (added if not ep.turns else ep.context() + added)

    def _added_ids(self, ep: Episode, messages: list[dict], tools) -> list[int]:
        if not ep.turns:  # the first turn: the whole conversation is the prompt
            if messages and messages[-1]["role"] == "assistant":
                raise RequestError("the last message is an assistant turn: continuing a turn the endpoint did not "
                                   "generate is not supported", param=f"messages[{len(messages) - 1}]")
            return self.tokenizer.encode(self._render(self._neutralized(messages), tools, generation_prompt=True),
                                         add_special_tokens=False)
        if (tools or None) != (ep.tools or None):
            raise RequestError(f"episode {ep.id!r}: tools differ from its first request's (they are part of its "
                               "prompt, which is never re-encoded); pass the same tools every turn", param="tools")
        known = ep.messages
        for i, old in enumerate(known):
            if i >= len(messages) or not _same(messages[i], old):
                got = json.dumps(messages[i])[:300] if i < len(messages) else "nothing"
                raise RequestError(f"episode {ep.id!r}: messages[{i}] must repeat the conversation as the endpoint "
                                   f"recorded it ({json.dumps(old)[:300]}), got {got}; earlier turns are never "
                                   "re-encoded, so a changed history cannot continue the episode",
                                   param=f"messages[{i}]", code="history_mismatch")
        new = messages[len(known):]
        if not new:
            raise RequestError(f"episode {ep.id!r}: the request adds no message after the last turn", param="messages")
        for i, m in enumerate(new, start=len(known)):
            if m["role"] == "assistant":
                raise RequestError(f"episode {ep.id!r}: messages[{i}] is an assistant turn the endpoint did not "
                                   "generate; only the model's own turns can be assistant messages",
                                   param=f"messages[{i}]", code="foreign_assistant_turn")
        known, new = self._neutralized(known), self._neutralized(new)
        before = self._render(known, tools, generation_prompt=False)
        after = self._render(known + new, tools, generation_prompt=True)
        if not after.startswith(before):
            raise RequestError("the chat template renders the conversation differently once messages are added (it "
                               "must only append); multi-turn episodes need an append-only template",
                               param="messages")
        end = before.rfind(self.eos_text)
        if end < 0:
            raise RequestError(f"the chat template does not end an assistant turn with {self.eos_text!r}")
        # the template's text after the recorded turn: its end-of-turn token too when the turn was cut
        text = before[end if not ep.ended_with_eos else end + len(self.eos_text):] + after[len(before):]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def record(self, ep: Episode, *, messages: list[dict], added: list[int], sampled: list[int],
               log_probs: list[float], reply: dict, ended_with_eos: bool) -> None:
        """The request's turn: what it added (the prompt on the first turn), then the sampled tokens."""
        with self._lock:
            if not ep.turns:
                ep.prompt = list(added)
            else:
                ep.tokens += added
                ep.mask += [0] * len(added)
                ep.log_probs += [0.0] * len(added)
            ep.tokens += sampled
            ep.mask += [1] * len(sampled)
            ep.log_probs += list(log_probs)
            ep.messages = list(messages) + [normalize_message(reply, len(messages))]
            ep.ended_with_eos = ended_with_eos
            ep.turns += 1
            ep.busy = False

    def release(self, ep: Episode) -> None:
        with self._lock:
            ep.busy = False
