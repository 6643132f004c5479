"""Run a coroutine on an event loop of its own (the calling thread's), uvloop's when it is installed:
the OpenAI endpoint's server and the environments' clients each run on one in a thread of their own."""

from __future__ import annotations

import asyncio


def run_loop(coro):
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
