"""Work follows the caller: a route's wait for the batcher ends, and the work is cancelled, when its client leaves
(or, for a body still arriving, when the server starts to drain)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

from starlette.types import Receive

from rerankit.errors import Cancelled

T = TypeVar("T")


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (its chunks leave the
    queue) and ``Cancelled`` is raised. Call once the body has been read: the next ``receive()`` then returns only
    when the connection closes (uvicorn's ``http.disconnect``; for each request on it, pipelined ones too:
    ``gone.py``)."""
    return await unless(work, _disconnect(receive),
                        lambda: Cancelled("the client disconnected before its answer was ready"))


async def unless(work: Awaitable[T], stop: Awaitable[Any], error: Callable[[], Exception]) -> T:
    """``work``'s result (or exception), unless ``stop`` completes first: then ``work`` is cancelled and awaited, and
    ``error()`` is raised. Cancelling the caller cancels ``work`` too."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled itself: the work goes too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise error()
    return task.result()


async def _disconnect(receive: Receive) -> None:
    """Returns when the client disconnects; never, on a transport that answers ``receive()`` after the body with
    anything but ``http.disconnect`` (it cannot tell, so the request is not cancelled)."""
    if (await receive())["type"] != "http.disconnect":
        await asyncio.Event().wait()
