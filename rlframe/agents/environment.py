"""Environments written against the OpenAI API: `async def episode(client, row)` runs one episode with
a standard `openai.AsyncOpenAI` client pointed at the policy's endpoint (openai_endpoint.py) and
returns its reward (a number) or a dict with "reward" and other numbers or booleans (logged as
metrics, a boolean as 0/1).

    async def episode(client, row):
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return {"reward": 1.0, "turns": 2}

`run_episodes` runs many at once (at most `concurrency`), each with its own episode id (the client
sends it as the X-Episode-Id header) and at most `timeout_s` seconds. An episode that raises, runs
out of time or returns something else than a finite number or such a dict is scored 0 and counted
by its status (error, timeout, bad_return); none of them can hold the step: the episodes run in a
thread of their own, so one that blocks its event loop is given up on after the step's deadline.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlframe.utils.event_loop import run_loop


def load_environment(spec: str) -> Callable:
    """`path/to/file.py:function` (agent.environment): the episode coroutine function, checked."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"agent.environment={spec!r} must be path/to/file.py:function_name")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"agent.environment={spec!r}: {file} is not a file")
    module_spec = importlib.util.spec_from_file_location(f"rlframe_environment_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"agent.environment={spec!r}: {file} defines no {name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent.environment={spec!r}: {name} must be `async def {name}(client, row)`")
    if len(inspect.signature(fn).parameters) < 2:
        raise ValueError(f"agent.environment={spec!r}: {name} must take (client, row)")
    return fn


@dataclass
class EpisodeResult:
    id: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    status: str = "timeout"  # ok, error, timeout, bad_return
    error: str = ""
    seconds: float = 0.0


def _score(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from what an episode returned; ValueError when it is neither form."""
    metrics = {}
    if isinstance(value, dict):
        # booleans count as 0/1, as a reward function's extras do (rlframe/rewards/manager.py)
        metrics = {k: float(v) for k, v in value.items() if k != "reward" and isinstance(v, (int, float))
                   and math.isfinite(v)}
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"an episode must return a finite number or a dict with a finite 'reward'; got {value!r}")
    return float(value), metrics


class Running:
    """How many episodes of a `run_episodes` call run now or are about to (read from other threads): every
    unfinished episode up to `concurrency`, counted from the call's start, before the first has sent a
    request (a count of started episodes would let a batch close on the first request to arrive).
    `on_finish` (if set) is called, from the episodes' thread, each time one ends."""

    def __init__(self, on_finish: Callable[[], None] | None = None):
        self.unfinished, self.concurrency, self.on_finish = 0, 1, on_finish

    def finished(self) -> None:
        self.unfinished -= 1
        if self.on_finish is not None:
            self.on_finish()

    @property
    def count(self) -> int:
        return min(self.unfinished, self.concurrency)


async def _one(fn, row, result: EpisodeResult, make_client, timeout_s: float, gate: asyncio.Semaphore,
               running: Running) -> None:
    async with gate:
        start = time.monotonic()
        client = make_client(result.id)  # shares the run's connection pool: nothing of its own to close
        try:
            value = await asyncio.wait_for(fn(client, row), timeout_s)
            try:
                result.reward, result.metrics = _score(value)
                result.status = "ok"
            except ValueError as err:
                result.status, result.error = "bad_return", str(err)
        except asyncio.TimeoutError:
            result.status, result.error = "timeout", f"did not finish within {timeout_s:.0f} s"
        except Exception as err:  # the environment's own failure: scored 0
            result.status, result.error = "error", f"{type(err).__name__}: {err}"
        finally:
            result.seconds = time.monotonic() - start
            running.finished()


def run_episodes(fn: Callable, rows: list, *, base_url: str, token: str, concurrency: int, timeout_s: float,
                 prefix: str | None = None, grace_s: float = 30.0, running: Running | None = None) -> list[EpisodeResult]:
    """One episode per row, `concurrency` at a time (0: all at once); results in row order (ids `prefix`-i). An
    episode's `timeout_s` counts from its start (with every episode at once, the call's: it covers the waits
    for batched generation too). Episodes still running `grace_s` after the last wave's timeout (one blocked
    the event loop) are given up on. `running` counts the episodes running at any moment (the endpoint's
    batcher reads it). What keeps the episodes from running at all (no HTTP client) is raised here."""
    import openai

    concurrency = concurrency or len(rows) or 1
    running = running if running is not None else Running()
    running.unfinished, running.concurrency = len(rows), concurrency

    prefix = prefix or uuid.uuid4().hex[:12]
    results = [EpisodeResult(id=f"{prefix}-{i}") for i in range(len(rows))]

    async def main():
        # one connection pool for all episodes (a client of its own costs each episode ~20 ms to build), on
        # aiohttp: httpx's pool checks every connection against every other on each request and response
        # (its cost grows as the square of the episodes at once: 50 requests/s at 128 here, 300 on aiohttp);
        # each episode's client is a copy of one base client with its episode id as a default header
        pool = openai.DefaultAioHttpClient(timeout=timeout_s, limits=_http_limits(_connections(concurrency)))
        base = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=timeout_s, http_client=pool)

        def make_client(episode_id: str):
            return base.with_options(default_headers={"X-Episode-Id": episode_id})

        gate = asyncio.Semaphore(concurrency)
        try:
            await asyncio.gather(*(_one(fn, row, res, make_client, timeout_s, gate, running)
                                   for row, res in zip(rows, results)))
        finally:
            await pool.aclose()

    failure: list[BaseException] = []

    def target():
        try:
            run_loop(main())
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            failure.append(err)

    thread = threading.Thread(target=target, name="environment-episodes", daemon=True)
    thread.start()
    waves = math.ceil(len(rows) / max(1, concurrency))
    thread.join(timeout=waves * timeout_s + grace_s)  # past this, an episode blocks its event loop: give up on it
    if failure:
        raise RuntimeError(f"the environment's episodes could not run: {type(failure[0]).__name__}: "
                           f"{failure[0]}") from failure[0]
    for res in results:
        if res.status == "timeout" and not res.error:
            res.error = "never finished (it blocked its event loop?); scored 0"
    return results


def _connections(concurrency: int) -> int:
    """Connections for `concurrency` episodes at once, within the open-files limit: the driver holds both
    ends of each (the endpoint serves in the same process); past it requests wait for a free connection."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = (soft - 512) // 2 if soft != resource.RLIM_INFINITY else concurrency + 8
    return max(16, min(concurrency + 8, room))


def _http_limits(connections: int):
    """Connection limits in the HTTP library the installed openai client is built on (httpx2 from openai 3)."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections)


def episode_metrics(results: list[EpisodeResult]) -> dict[str, float]:
    """agent/env_* metrics: statuses, reward and time per episode, and the mean of every number returned."""
    n = max(1, len(results))
    out = {f"agent/env_{s}_frac": sum(r.status == s for r in results) / n
           for s in ("ok", "error", "timeout", "bad_return")}
    out["agent/env_reward_mean"] = sum(r.reward for r in results) / n
    out["agent/env_seconds_max"] = max((r.seconds for r in results), default=0.0)
    for key in sorted({k for r in results for k in r.metrics}):
        vals = [r.metrics[key] for r in results if key in r.metrics]
        out[f"agent/env/{key}"] = sum(vals) / len(vals)
    return out
