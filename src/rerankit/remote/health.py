"""Whether a remote backend's far server can take requests: what a proxy's ``/health`` answers.

The far server is healthy while a request to it has succeeded in the last ``interval`` seconds; else one probe (a
GET of ``HEALTH_PATH`` on every endpoint at once, on connections of its own, within ``timeout``) decides, and its
verdict is kept for ``interval`` seconds, so that however often a load balancer asks, the far server sees at most one
probe per interval. An endpoint is healthy when it answers the probe with any status below 500: vLLM, SGLang, TEI,
Infinity and ``rerankit serve`` answer ``/health`` 200 when they can score and 5xx when they cannot; a server
without the route (Cohere's API) answers 404, which still shows it up.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import httpx

from rerankit.errors import hide_credentials
from rerankit.remote.client import Transport

HEALTH_PATH = "/health"
PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 2.0
CLOSED = "the remote backend is closed"


class FarHealth:
    """The far server's health as last seen, probed at most once per ``interval`` seconds."""

    def __init__(self, transport: Transport, interval: float = PROBE_INTERVAL_S, timeout: float = PROBE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.timeout = timeout
        self._transport = transport
        self._clock = clock
        self._checked_at: float | None = None
        self._problem: str | None = None
        self._probe: asyncio.Task[str | None] | None = None

    async def problem(self) -> str | None:
        """None while the far server is healthy; else what is wrong with it (no credentials in it). A closed backend
        is not healthy, and its far server is not probed: nothing would ask it for anything."""
        if self._transport.closed:
            return CLOSED
        if self._transport.endpoints.since_answer() < self.interval:
            return None
        if self._checked_at is not None and self._clock() - self._checked_at < self.interval:
            return self._problem
        return await self._shared_probe()

    async def _shared_probe(self) -> str | None:
        """The running probe's verdict, or a new probe's: callers asking at once share one."""
        loop = asyncio.get_running_loop()
        if self._probe is None or self._probe.done() or self._probe.get_loop() is not loop:
            self._probe = loop.create_task(self._run_probe())
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> str | None:
        urls = self._transport.endpoints.urls
        problems = await asyncio.gather(*(self._probe_one(url) for url in urls))
        self._problem = None if None in problems else _unhealthy(urls, problems)
        self._checked_at = self._clock()
        return self._problem

    async def _probe_one(self, url: str) -> str | None:
        """None when ``url`` answers its health route below 500; else why not."""
        try:
            async with self._transport.probe_client(self.timeout) as client:
                status = await asyncio.wait_for(_status_of(client, url + HEALTH_PATH), self.timeout)
        except (httpx.TimeoutException, asyncio.TimeoutError):
            return f"no answer within {self.timeout:g} s"
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # a refused connection, a reset, an unknown name...
            return type(exc).__name__
        return None if status < 500 else f"its {HEALTH_PATH} answered {status}"


async def _status_of(client: httpx.AsyncClient, url: str) -> int:
    """The status of a GET of ``url``, its body left unread."""
    async with client.stream("GET", url) as response:
        return response.status_code


def _unhealthy(urls: list[str], problems: list[str | None]) -> str:
    """One line naming each far URL (without credentials) and what is wrong with it."""
    if len(urls) == 1:
        return f"far server {hide_credentials(urls[0])} is unreachable ({problems[0]})"
    named = "; ".join(f"{hide_credentials(url)} ({problem})" for url, problem in zip(urls, problems))
    return f"no far server is reachable: {named}"
