"""An OpenAI-compatible HTTP endpoint over the rollout engines, for agents written against the OpenAI API.

    endpoint = OpenAIEndpoint(generate, tokenizer, model="policy", response_length=256)
    endpoint.start()            # a uvicorn server on 127.0.0.1 (port 0: a free one), in a thread
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.token,
                                default_headers={"X-Episode-Id": "ep-0"})
    ...                         # the agent's chat.completions.create calls
    episodes = endpoint.store.pop_all()   # token-exact records (episodes.py)
    endpoint.close()

Routes: GET /v1/models; POST /v1/chat/completions (messages, tools=[...] in, tool_calls out: the
model's `<tool_call>` blocks parsed by rlframe/agents/calls.py; the tokenizer's chat template renders
the conversation); POST /v1/completions (a prompt string, the first turn of an episode of its own
unless it names one). Every request carries the run's token (`Authorization: Bearer ...`) and an
episode id (the `X-Episode-Id` header, else the `user` field, else a fresh one); episodes.py keeps
each episode's tokens exactly as sampled.

Sampling: temperature, top_p, top_k (an extra body field), max_tokens / max_completion_tokens, seed;
n must be 1 (one episode is one trajectory: run n episodes); stream, stop strings, logit_bias,
penalties, response_format and tool_choice other than auto are refused with an OpenAI-style error
(HTTP 400, {"error": {"message", "type", "param", "code"}}). A request's tokens count against the
episode's response budget (data.response_length: the trajectory is one training row).

Generation: a batch of requests closes once none has arrived for `batch_window_s` (20 ms), or
`batch_max_wait_s` (0.5 s) after its first; then every waiting request goes to `generate` in one call
per sampling setting (`max_tokens` is the largest of them; each output is cut to its own request's),
so concurrent episodes share batched generation as the in-process agent loop's turns do; an
episode's requests go to the generation replica of its first (session affinity, its prefix cache:
rlframe/workers/rollout/affinity.py). One generation thread; the HTTP server runs in a thread of its own.

Security: bound to 127.0.0.1 unless a host is given; a random token per endpoint; request bodies
above `max_request_bytes` are refused (413); a request that waits for generation longer than
`request_timeout_s` gets 504.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import random
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here

from rlframe.agents.episodes import EpisodeStore, RequestError, normalize_message
from rlframe.utils.event_loop import run_loop
from rlframe.workers.rollout.affinity import ReplicaAffinity

UNSUPPORTED = {"stream": "streaming is not supported; set stream=false",
               "stop": "stop strings are not supported (a turn ends at the model's end-of-turn token)",
               "logit_bias": "logit_bias is not supported", "response_format": "response_format is not supported",
               "presence_penalty": "presence_penalty is not supported", "frequency_penalty": "frequency_penalty is not "
               "supported", "functions": "the legacy `functions` field is not supported; pass tools=[...]",
               "best_of": "best_of is not supported", "echo": "echo is not supported", "suffix": "suffix is not supported"}


_WAKE = object()  # in the batcher's queue: re-check `ready`


@dataclass
class _Job:
    ids: list[int]
    max_tokens: int
    key: tuple  # (temperature, top_p, top_k): requests with one key share a generate call
    seed: int
    episode: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class GenerationBatcher:
    """One thread that sends every waiting request to `generate(prompts DataProto, SamplingConfig)` in
    one call per sampling setting and resolves each request's future with (sampled ids, log-probs,
    whether it ended with an end-of-sequence id)."""

    def __init__(self, generate, *, pad_id: int, eos_ids, max_batch: int = 256, window_s: float = 0.02,
                 max_wait_s: float = 0.5):
        self.generate, self.pad_id, self.eos_ids = generate, pad_id, set(eos_ids)
        self.max_batch, self.window_s, self.max_wait_s = max_batch, window_s, max_wait_s
        # ready(n): whether n waiting requests are all there will be for now (every running episode is
        # waiting for a reply): the batch closes at once. Set by whoever runs the episodes.
        self.ready = None
        # `generate` spreads a call over this many replicas; an episode's turns go to its first one's
        self.replicas, self.affinity = 1, ReplicaAffinity()
        self._queue: queue.Queue = queue.Queue()
        self.calls = self.rows = 0
        self._thread = threading.Thread(target=self._loop, name="endpoint-generation", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], *, max_tokens: int, temperature: float, top_p: float, top_k: int,
               seed: int | None, episode: str = "") -> concurrent.futures.Future:
        job = _Job(ids, max_tokens, (temperature, top_p, top_k), random.getrandbits(62) if seed is None else seed,
                   episode)
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def wake(self) -> None:
        """Look at `ready` again now (what it reads changed: an episode ended without another request)."""
        self._queue.put(_WAKE)

    def _loop(self) -> None:
        """A batch closes when no request has arrived for `window_s`, at `max_batch` requests, or `max_wait_s`
        after its first: concurrent episodes' requests trickle in (each client parses its last reply and
        renders the next turn first), and a call per few requests would cost more than the wait; at once
        when `ready` says every running episode is waiting (checked at each request and each `wake`)."""
        while (first := self._queue.get()) is not None:
            if first is _WAKE:
                continue
            jobs, cap = [first], time.monotonic() + self.max_wait_s
            while len(jobs) < self.max_batch and not (self.ready is not None and self.ready(len(jobs))):
                try:
                    job = self._queue.get(timeout=max(0.0, min(self.window_s, cap - time.monotonic())))
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)
                    break
                if job is not _WAKE:
                    jobs.append(job)
            for key in dict.fromkeys(j.key for j in jobs):
                self._run([j for j in jobs if j.key == key])

    def _run(self, jobs: list[_Job]) -> None:
        from rlframe.protocol import DataProto
        from rlframe.workers.rollout import SamplingConfig
        from rlframe.workers.rollout.batch import prompts_from_rows
        from rlframe.workers.rollout.seeds import SEED_KEY

        temperature, top_p, top_k = jobs[0].key
        jobs = [jobs[i] for i in self.affinity.order([j.episode for j in jobs], self.replicas)]
        try:
            gen_in = DataProto.from_dict(tensors=prompts_from_rows([j.ids for j in jobs], pad_id=self.pad_id))
            gen_in.batch[SEED_KEY] = torch.tensor([j.seed for j in jobs], dtype=torch.long)
            sampling = SamplingConfig(n=1, temperature=temperature, top_p=top_p, top_k=top_k,
                                      max_new_tokens=max(j.max_tokens for j in jobs))
            out, _ = self.generate(gen_in, sampling)
            self.calls, self.rows = self.calls + 1, self.rows + len(jobs)
            resp, rmask, lps = out.batch["responses"], out.batch["response_mask"].bool(), out.batch["rollout_log_probs"]
            for i, job in enumerate(jobs):
                toks, lp = resp[i][rmask[i]].tolist()[:job.max_tokens], lps[i][rmask[i]].tolist()[:job.max_tokens]
                job.future.set_result((toks, lp, bool(toks) and toks[-1] in self.eos_ids))
        except BaseException as err:  # every waiting request learns why
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(err)


@dataclass
class EndpointLimits:
    max_request_bytes: int = 1 << 20
    max_tokens: int | None = None  # per request; None: the episode's budget left
    request_timeout_s: float = 300.0
    max_batch: int = 256
    batch_window_s: float = 0.02  # a batch closes after this long without a new request ...
    batch_max_wait_s: float = 0.5  # ... or this long after its first
    max_prompt_tokens: int | None = None  # an episode's first prompt (data.prompt_length in training)


def _error(err: RequestError):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": str(err), "type": err.kind, "param": err.param, "code": err.code}},
                        status_code=err.status)


class OpenAIEndpoint:
    """See the module docstring. `generate` is the rollout's (rlframe.controller.trainers.agent_loop.Generate)."""

    def __init__(self, generate, tokenizer, *, model: str, response_length: int, host: str = "127.0.0.1",
                 port: int = 0, limits: EndpointLimits | None = None):
        from rlframe.workers.rollout.stops import end_of_sequence_ids

        self.tokenizer, self.model, self.response_length = tokenizer, model, response_length
        self.limits = limits or EndpointLimits()
        self.token = secrets.token_urlsafe(24)
        self.eos_ids = end_of_sequence_ids(tokenizer)
        self.store = EpisodeStore(tokenizer, eos_text=tokenizer.eos_token)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batcher = GenerationBatcher(generate, pad_id=pad, eos_ids=self.eos_ids, max_batch=self.limits.max_batch,
                                         window_s=self.limits.batch_window_s, max_wait_s=self.limits.batch_max_wait_s)
        self.requests = {"ok": 0, "refused": 0, "timed_out": 0, "failed": 0}
        # Training sets these per rollout (`plan`): the sampling the trainer's log-probs assume, which a
        # request may repeat but not change, and each episode's (seed, sample) for unseeded requests.
        self.fixed: dict | None = None
        self.seeds: dict[str, tuple[int, int]] = {}
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = self._thread = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def plan(self, *, temperature: float, top_p: float, top_k: int, seeds: dict[str, tuple[int, int]]) -> None:
        """The sampling every request must use until the next plan (a request may omit it or repeat it: the
        trainer's log-probs assume it), and the seed of each named episode's sample: turn t of an episode
        with (seed, sample) is seeded from (seed, sample, t), as the in-process agent loop seeds its turns."""
        self.fixed = {"temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k)}
        self.seeds = dict(seeds)
        self.batcher.affinity = ReplicaAffinity()  # episode ids are the rollout's

    # the server
    def start(self, timeout_s: float = 30.0) -> "OpenAIEndpoint":
        import uvicorn

        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                                http="auto")  # httptools when installed; the loop is uvloop's when installed (run_loop)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: run_loop(self._server.serve(sockets=[self._sock])),
                                        name="openai-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the OpenAI endpoint did not start on {self.base_url} within {timeout_s:.0f} s")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._server = None
        self.batcher.close()
        self._sock.close()

    def app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI(title="rlframe policy endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def guard(request: Request) -> None:
            """The token and the declared body size, before the body is read (a route check rather than an
            HTTP middleware, which costs every request about a millisecond)."""
            if request.headers.get("authorization", "") != f"Bearer {self.token}":
                raise RequestError("a valid token is required (Authorization: Bearer <token>, the endpoint's "
                                   "token)", status=401, kind="authentication_error", code="invalid_api_key")
            size = request.headers.get("content-length")
            if size is not None and int(size) > self.limits.max_request_bytes:
                raise RequestError(f"the request body has {size} bytes; the endpoint takes at most "
                                   f"{self.limits.max_request_bytes}", status=413, code="request_too_large")

        @app.get("/v1/models")
        async def models(request: Request):
            try:
                guard(request)
            except RequestError as err:
                self.requests["refused"] += 1
                return _error(err)
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                "owned_by": "rlframe"}]}

        async def handle(request: Request, chat: bool):
            try:
                guard(request)
                body = await request.body()
                if len(body) > self.limits.max_request_bytes:
                    raise RequestError(f"the request body has {len(body)} bytes; the endpoint takes at most "
                                       f"{self.limits.max_request_bytes}", status=413, code="request_too_large")
                try:
                    req = json.loads(body)
                except json.JSONDecodeError as err:
                    raise RequestError(f"the request body is not JSON ({err.msg} at char {err.pos})") from err
                if not isinstance(req, dict):
                    raise RequestError("the request body must be a JSON object")
                episode = request.headers.get("x-episode-id") or req.get("user") or f"anon-{uuid.uuid4().hex}"
                reply = await self._complete(req, str(episode), chat=chat)
                self.requests["ok"] += 1
                return JSONResponse(reply)
            except RequestError as err:
                self.requests["timed_out" if err.status == 504 else "refused"] += 1
                return _error(err)
            except Exception as err:  # generation failed: the client sees why, the server goes on
                self.requests["failed"] += 1
                return _error(RequestError(f"generation failed: {type(err).__name__}: {err}", status=500,
                                           kind="server_error"))

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        return app

    # one request
    def _sampling(self, req: dict) -> dict:
        for name, why in UNSUPPORTED.items():
            if req.get(name) not in (None, False, 0, [], {}) and not (name == "stop" and req.get(name) in ("", None)):
                raise RequestError(why, param=name, code="unsupported_parameter")
        if req.get("model") not in (None, self.model):
            raise RequestError(f"model {req.get('model')!r} is not served here; the policy is {self.model!r} "
                               "(GET /v1/models)", param="model", code="model_not_found", status=404)
        if req.get("n", 1) != 1:
            raise RequestError("n must be 1: an episode is one trajectory (run n episodes for n samples)", param="n")
        if req.get("tool_choice") not in (None, "auto"):
            raise RequestError("tool_choice must be auto (the model decides when to call a tool)", param="tool_choice")
        if req.get("logprobs") is not None and not isinstance(req.get("logprobs"), (bool, int)):
            raise RequestError("logprobs must be a boolean (chat) or an integer (completions)", param="logprobs")
        temperature = req.get("temperature", 1.0)
        top_p, top_k = req.get("top_p", 1.0), req.get("top_k", -1)
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise RequestError(f"temperature={temperature!r} must be a number in [0, 2]", param="temperature")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise RequestError(f"top_p={top_p!r} must be in (0, 1]", param="top_p")
        if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
            raise RequestError(f"top_k={top_k!r} must be -1 (off) or >= 1", param="top_k")
        max_tokens = req.get("max_completion_tokens", req.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise RequestError(f"max_tokens={max_tokens!r} must be a positive integer", param="max_tokens")
        seed = req.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise RequestError(f"seed={seed!r} must be an integer", param="seed")
        out = {"temperature": float(temperature), "top_p": float(top_p), "top_k": top_k, "max_tokens": max_tokens,
               "seed": seed}
        for name, value in (self.fixed or {}).items():
            if name in req and out[name] != value:
                raise RequestError(f"{name}={req[name]!r}: this run samples with {name}={value!r} (the trainer's "
                                   "log-probs assume it: rollout.temperature, top_p, top_k); omit it or pass that "
                                   "value", param=name, code="sampling_fixed")
            out[name] = value
        return out

    def _messages(self, req: dict, chat: bool) -> list[dict]:
        if chat:
            messages = req.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("messages must be a non-empty list", param="messages")
            return [normalize_message(m, i) for i, m in enumerate(messages)]
        prompt = req.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string (token-id prompts are not supported)", param="prompt")
        return [{"role": "user", "content": prompt}]

    async def _complete(self, req: dict, episode_id: str, *, chat: bool) -> dict:
        sampling = self._sampling(req)
        messages = self._messages(req, chat)
        tools = req.get("tools") if chat else None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RequestError("tools must be a list of tool objects", param="tools")
        if self.seeds and episode_id not in self.seeds:  # e.g. an episode of an earlier rollout given up on
            raise RequestError(f"episode {episode_id!r} is not one of this rollout's episodes", status=409,
                               code="episode_not_in_rollout")
        ep, added, context = self.store.begin(episode_id, messages, tools)
        try:
            if not ep.turns and self.limits.max_prompt_tokens and len(added) > self.limits.max_prompt_tokens:
                raise RequestError(f"the episode's first prompt has {len(added)} tokens; this run takes at most "
                                   f"{self.limits.max_prompt_tokens} (data.prompt_length)", param="messages",
                                   code="context_length_exceeded")
            if sampling["seed"] is None and episode_id in self.seeds:
                from rlframe.workers.rollout.seeds import mix_seed

                sampling["seed"] = mix_seed(*self.seeds[episode_id], ep.turns + 1)
            left = self.response_length - (len(ep.tokens) + (len(added) if ep.turns else 0))
            if left <= 0:
                raise RequestError(f"episode {episode_id!r} has used its {self.response_length} response tokens "
                                   "(data.response_length: one episode is one training row)", param="messages",
                                   code="context_length_exceeded")
            limit = min(x for x in (left, sampling["max_tokens"], self.limits.max_tokens) if x is not None)
            future = self.batcher.submit(context, max_tokens=limit, temperature=sampling["temperature"],
                                         top_p=sampling["top_p"], top_k=sampling["top_k"], seed=sampling["seed"],
                                         episode=episode_id)
            try:
                sampled, log_probs, ended = await asyncio.wait_for(asyncio.wrap_future(future),
                                                                   self.limits.request_timeout_s)
            except asyncio.TimeoutError as err:
                raise RequestError(f"generation took longer than {self.limits.request_timeout_s:.0f} s",
                                   status=504, kind="timeout", code="timeout") from err
        except BaseException:
            self.store.release(ep)
            raise
        reply, finish = self._reply_message(sampled, ended, episode_id, ep.turns)
        self.store.record(ep, messages=messages, added=added, sampled=sampled, log_probs=log_probs, reply=reply,
                          ended_with_eos=ended)
        usage = {"prompt_tokens": len(context), "completion_tokens": len(sampled),
                 "total_tokens": len(context) + len(sampled)}
        created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if chat:
            choice = {"index": 0, "message": {k: v for k, v in reply.items() if v is not None or k == "content"},
                      "finish_reason": finish, "logprobs": None}
            if req.get("logprobs"):
                choice["logprobs"] = {"content": self._token_logprobs(sampled, log_probs)}
            return {"id": rid, "object": "chat.completion", "created": created, "model": self.model,
                    "choices": [choice], "usage": usage}
        text = self.tokenizer.decode(sampled[:-1] if ended else sampled, skip_special_tokens=False)
        choice = {"index": 0, "text": text, "finish_reason": "stop" if ended else "length", "logprobs": None}
        if req.get("logprobs"):
            entries = self._token_logprobs(sampled, log_probs)
            choice["logprobs"] = {"tokens": [e["token"] for e in entries],
                                  "token_logprobs": [e["logprob"] for e in entries]}
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model,
                "choices": [choice], "usage": usage}

    def _token_logprobs(self, ids: list[int], log_probs: list[float]) -> list[dict]:
        return [{"token": self.tokenizer.decode([t], skip_special_tokens=False), "logprob": lp, "token_id": t}
                for t, lp in zip(ids, log_probs)]

    def _reply_message(self, sampled: list[int], ended: bool, episode_id: str, turn: int) -> tuple[dict, str]:
        """The assistant message of a turn: its text without the end-of-turn token, the `<tool_call>` blocks
        as OpenAI tool_calls (ids unique in the episode); the finish reason."""
        from rlframe.agents.calls import TOOL_CALL_START, ToolCall, parse_tool_calls

        text = self.tokenizer.decode(sampled[:-1] if ended else sampled, skip_special_tokens=False)
        calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)]
        if not calls:
            return {"role": "assistant", "content": text}, "stop" if ended else "length"
        content = text[:text.find(TOOL_CALL_START)].strip()
        tool_calls = [{"id": f"call_{turn}_{k}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for k, c in enumerate(calls)]
        return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, \
            "tool_calls" if ended else "length"
