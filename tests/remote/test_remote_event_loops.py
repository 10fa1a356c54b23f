"""One remote backend used from event loops in several threads at once (asyncio.run in worker threads: job
runners, Django's async_to_sync, LlamaIndex's asyncio_run)."""

from __future__ import annotations

import asyncio
import threading

import httpx

from rerankit.remote import RemoteBackend
from rerankit.schema import ScoreRequest
from test_remote_backend import DOCS, FakeServer


def test_event_loops_in_several_threads_each_keep_one_async_client(monkeypatch):
    # asyncio.run in worker threads (job runners, Django's async_to_sync, LlamaIndex's asyncio_run): the loops
    # took turns replacing one client, a new AsyncClient and new connections at every switch, and a replaced
    # client was closed under the requests still using it (ReadError, retried).
    clients: list[int] = []
    made = httpx.AsyncClient.__init__

    def counted(self, *args, **kwargs):
        clients.append(id(self))
        made(self, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "__init__", counted)
    remote = RemoteBackend("http://fake:8000", dialect="cohere", transport=httpx.MockTransport(FakeServer()))
    loops, calls = 4, 10
    turns = threading.Barrier(loops)
    results: list[list[float]] = []

    def worker() -> None:
        async def run() -> None:
            for _ in range(calls):
                turns.wait()  # every loop makes its n-th call before any makes its next
                results.append((await remote.ascore(ScoreRequest(query="q", items=DOCS[:2]))).scores)
        asyncio.run(run())

    threads = [threading.Thread(target=worker) for _ in range(loops)]
    [thread.start() for thread in threads]
    [thread.join(timeout=60) for thread in threads]
    remote.close()
    assert results == [[0.0, 0.01]] * (loops * calls)
    assert len(clients) == loops, f"{len(clients)} AsyncClients for {loops} loops"
