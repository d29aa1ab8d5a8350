"""The runtime's asyncio helpers: its event loop, waiting for device events by polling (never
blocking the loop), and gathering tasks so that every failure is retrieved."""

from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else the default loop."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


async def gather_all(coros) -> list:
    """Run coroutines concurrently; wait for every one, then raise the first failure. (A plain
    gather raises at the first failure and leaves the others' exceptions unretrieved: asyncio
    then prints their tracebacks, e.g. when several expert files fail their checksum.)"""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def settled(tasks) -> None:
    """Wait for every task, ignoring their outcomes (shutdown)."""
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0)  # callbacks the reader threads queued run now


async def event_done(ev) -> None:
    """Wait for an event without blocking the loop: query, yield, back off to 100 us."""
    delay = 0.0
    while not ev.query():
        await asyncio.sleep(delay)
        delay = min(1e-4, delay * 2 or 5e-6)
