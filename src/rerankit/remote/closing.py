"""What ``close()`` does to a remote backend's calls: those running end at once with ``Cancelled``, sync or async,
whichever thread or event loop runs them; those begun after it fail at once.

Each call runs under a ``Stop`` registered with its transport's ``Calls``. A sync call waits on its stop (between
tries, between discovery's rounds) and hands it to its socket reads; an async call runs its waits in tasks started
through the stop, which cancels them on their own loop (``call_soon_threadsafe``) when it is set from any thread.
Registering checks the closed flag under the lock that ``close`` sets it under, so no call slips in between.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Any, Awaitable, Iterator, TypeVar

from rerankit.errors import Cancelled

CLOSED_WHILE_RUNNING = "the remote backend was closed while this call ran"
CLOSED_BEFORE = "the remote backend was closed before this call began: make a new one to score again"

T = TypeVar("T")


class Stop(threading.Event):
    """One call's stop, with why it was set where that is not the call's own failure (``reason``).

    Once set, from any thread: sync waits on it (``wait``) end, and the tasks started through ``start`` are
    cancelled on their event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None
        # Touched only on the loop's own thread (``start``, ``_cancel_tasks`` and the tasks' done callbacks).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Future[Any]] = set()

    def set(self, reason: str | None = None) -> None:
        if reason is not None and self.reason is None:
            self.reason = reason
        super().set()
        loop = self._loop  # read after the flag is up: a task started later sees the flag (``start``)
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._cancel_tasks)
            except RuntimeError:  # its loop is closed, and the tasks ended with it
                pass

    def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def start(self, awaitable: Awaitable[T]) -> asyncio.Future[T]:
        """``awaitable`` as a task of the running loop, cancelled once the stop is set (at once if it is)."""
        task = asyncio.ensure_future(awaitable)
        self._loop = task.get_loop()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self.is_set():
            task.cancel()
        return task

    async def run(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` as a task (``start``): ``Cancelled``, with the reason, once the stop ends it; the
        caller's own cancellation goes to the task and is raised as it is."""
        task = self.start(awaitable)
        try:
            return await task
        except asyncio.CancelledError:
            if self.reason is None or _cancelling():
                raise
            raise Cancelled(self.reason) from None

    def check(self, default: str) -> None:
        """``Cancelled`` once set: with the reason, else ``default``."""
        if self.is_set():
            raise Cancelled(self.reason or default)


def _cancelling() -> bool:
    """Whether the running task has been asked to cancel (Python 3.11+; on 3.10, taken as not)."""
    task = asyncio.current_task()
    return bool(getattr(task, "cancelling", lambda: 0)())


class Calls:
    """The calls running on one transport, each under a ``Stop`` (``stoppable``), which ``close`` sets; once closed,
    no call begins."""

    def __init__(self, closed: bool = False) -> None:
        self._lock = threading.Lock()
        self._stops: set[Stop] = set()
        self.closed = closed

    @contextmanager
    def stoppable(self) -> Iterator[Stop]:
        """A stop for the call run in the block, registered for ``close`` to set; ``Cancelled`` at once when closed
        (checked under the lock ``close`` holds, so a close at any moment is seen by the call)."""
        stop = Stop()
        with self._lock:
            if self.closed:
                raise Cancelled(CLOSED_BEFORE)
            self._stops.add(stop)
        try:
            yield stop
        finally:
            with self._lock:
                self._stops.discard(stop)

    def close(self) -> None:
        """No call begins from now on; those running end at once with ``Cancelled``."""
        with self._lock:
            self.closed = True
            stops, self._stops = self._stops, set()
        for stop in stops:
            stop.set(CLOSED_WHILE_RUNNING)

    def check_open(self) -> None:
        """``Cancelled`` once closed: for a call past its registration that would open a new pool."""
        if self.closed:
            raise Cancelled(CLOSED_WHILE_RUNNING)
