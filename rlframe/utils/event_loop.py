"""Run a coroutine on an event loop of its own (the calling thread's), uvloop's when it is installed:
the OpenAI endpoint's server and the environments' clients each run on one in a thread of their own."""

from __future__ import annotations

import asyncio


def run_loop(coro):
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            left = asyncio.all_tasks(loop)  # what the coroutine left running
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
