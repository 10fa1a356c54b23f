"""Cancelling an async call of the embedded engine (a handler's timeout, asyncio.wait_for, a client gone) stops
its work."""

from __future__ import annotations

import asyncio
import time

import pytest

from rerankit.engine import EmbeddedBackend
from rerankit.schema import ScoreRequest


def test_cancelling_an_async_call_stops_its_work(tiny_qwen3_lm):
    # asyncio.wait_for's timeout, a FastAPI client gone, task.cancel(): the call used to score on to its end on
    # the worker thread, holding the model, and the next call waited for it.
    backend = EmbeddedBackend(str(tiny_qwen3_lm), max_batch_tokens=64)  # many small micro-batches
    try:
        ran = []
        forward_read = backend._runner.forward_read

        def slowed(batch):
            ran.append(batch)
            time.sleep(0.01)
            return forward_read(batch)

        backend._runner.forward_read = slowed
        big = ScoreRequest(query="q", items=[f"document number {i} about nothing" for i in range(100)])
        backend.score(big)
        whole = len(ran)

        async def cancel_midway() -> None:
            ran.clear()
            task = asyncio.ensure_future(backend.ascore(big))
            while len(ran) < 3:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await backend.ascore(ScoreRequest(query="q", items=["a", "b"]))  # waits for the model to be free

        asyncio.run(cancel_midway())
        assert whole > 20 and len(ran) < whole / 2, (len(ran), whole)
        assert [r.index for r in backend.score(ScoreRequest(query="q", items=["a", "b"])).results] == [0, 1]
    finally:
        backend.close()
