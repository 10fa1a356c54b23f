"""The fair queue (``server/scheduler.py``) and how the batcher uses it: chunks, fairness, company, cancellation,
limits, drain and warm-up shapes, against fake backends (no model)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from server_fakes import RecordingBackend

from rerankit.errors import Cancelled, RequestTooLarge, ShuttingDown
from rerankit.schema import ScoreRequest
from rerankit.server.batcher import WARM_UP_ITEM_OVERHEAD, Batcher, warm_up_shapes
from rerankit.server.limits import ServerConfig
from rerankit.server.scheduler import Chunk, FairQueue, Submission, item_tokens, split


class StoppableBackend(RecordingBackend):
    """Holds every call on its gate, asking ``should_stop`` between its "micro-batches" like the engine does."""

    def __init__(self) -> None:
        super().__init__(hold_first_call=True)
        self.stopped = threading.Event()

    def score_batch(self, requests, *, return_exceptions=False, should_stop=None):
        self.calls.append([request.query for request in requests])
        self.requests.extend(requests)
        self.entered.set()
        while not self.gate.wait(0.01):
            if should_stop is not None and should_stop():
                self.stopped.set()
                raise Cancelled("stopped")
        return [self._respond(request) for request in requests]


class ShapeRecorder(RecordingBackend):
    """Records the warm-up shapes it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int]] = []

    def warm_up(self, shapes=None):
        self.shapes = list(shapes)
        return 0.0


async def started(backend, **config) -> Batcher:
    batcher = Batcher(backend, ServerConfig(**config))
    batcher.start()
    return batcher


def queued(queue: FairQueue, query: str, tokens: list[int], chunk_tokens: int) -> Submission:
    request = ScoreRequest(query=query, items=["d"] * len(tokens))
    submission = Submission(request, split(tokens, chunk_tokens, 512), asyncio.get_running_loop().create_future())
    queue.add(submission)
    return submission


def test_chunks_hold_at_most_the_token_and_item_budgets_and_an_oversized_item_alone():
    assert split([3, 3, 3, 10, 1], chunk_tokens=6, chunk_items=10) == [
        Chunk(0, 2, 6), Chunk(2, 3, 3), Chunk(3, 4, 10), Chunk(4, 5, 1)]
    assert split([1] * 5, chunk_tokens=100, chunk_items=2) == [Chunk(0, 2, 2), Chunk(2, 4, 2), Chunk(4, 5, 1)]


def test_token_estimate_cuts_items_to_the_request_and_model_limits():
    request = ScoreRequest(query="abcd", items=["x" * 4000, "y" * 8], max_tokens_per_item=700)
    assert item_tokens(request) == [1 + 700, 1 + 2]
    assert item_tokens(request, cap=512) == [512, 3]


def test_token_estimate_counts_every_window_of_a_windowed_item():
    """An item scored in windows feeds the model each window with the query: a request of long documents in
    windows is weighed as such against max_request_tokens (it was counted as one pair an item)."""
    long, short = "x" * 4 * 2000, "y" * 8  # ~2,000 and 2 tokens
    request = ScoreRequest(query="abcd", items=[long, short], long_documents="max")
    size, stride = 511, 511 * 3 // 4  # the room a 512-token model leaves after the 1-token query
    windows = 1 + -(-(2000 - size) // stride)
    assert item_tokens(request, cap=512) == [windows * 512, 3]
    capped = request.model_copy(update={"long_document_max_windows": 2, "long_document_window": 100})
    assert item_tokens(capped, cap=512) == [2 * 101, 3]
    assert item_tokens(request) == [1 + 2000, 3]  # the model's length unknown: the item whole


async def test_an_engine_call_takes_one_chunk_of_each_waiting_request_and_the_newcomer_joins_the_next():
    queue = FairQueue()
    big = queued(queue, "big", [100] * 10, chunk_tokens=200)
    assert [piece.chunk for piece in queue.take(512, 10_000)] == [Chunk(0, 2, 200)]
    small = queued(queue, "small", [5, 5], chunk_tokens=200)
    second = queue.take(512, 10_000)
    assert [(piece.submission, piece.chunk) for piece in second] == [(big, Chunk(2, 4, 200)), (small, Chunk(0, 2, 10))]
    assert second[0].request().items == ["d", "d"] and second[1].request() is small.request


async def test_newcomers_cannot_starve_a_large_request_when_the_budget_takes_one_chunk():
    queue = FairQueue()
    queued(queue, "big", [100] * 6, chunk_tokens=100)
    owners = []
    for number in range(6):
        queued(queue, f"new{number}", [100], chunk_tokens=100)
        owners += [piece.submission.request.query for piece in queue.take(512, 100)]
    assert owners.count("big") >= 2, owners  # it takes turns with the newcomers
    assert "big" in owners[-3:], owners


async def test_chunk_results_are_put_together_in_input_order_with_usage_summed():
    backend = RecordingBackend()
    batcher = await started(backend, max_chunk_tokens=4, max_batch_tokens=4)
    request = ScoreRequest(query=[1], items=[[2] * n for n in (1, 2, 3, 1, 2)])  # pairs of 2, 3, 4, 2, 3 tokens
    response = await batcher.submit(request)
    await batcher.stop()
    assert [len(chunk.items) for chunk in backend.requests] == [1, 1, 1, 1, 1]
    assert [result.index for result in response.results] == [0, 1, 2, 3, 4]
    assert response.scores == [1.0, 2.0, 3.0, 1.0, 2.0]  # the fake scores an item by its length
    assert response.usage.prompt_tokens == 9


async def test_a_failing_chunk_fails_its_request_once_and_its_other_chunks_leave_the_queue():
    class FailsSecondChunk(RecordingBackend):
        def _respond(self, request):
            if request.items == ["b"]:
                raise RuntimeError("engine fault")
            return super()._respond(request)

    backend = FailsSecondChunk()
    batcher = await started(backend, max_batch_items=1)
    with pytest.raises(RuntimeError, match="engine fault"):
        await batcher.submit(ScoreRequest(query="q", items=["a", "b", "c", "d"]))
    assert (await batcher.submit(ScoreRequest(query="next", items=["a"]))).scores == [1.0]
    await batcher.stop()
    assert [call for call in backend.calls if call == ["q"]] == [["q"], ["q"]]  # chunks 3 and 4 never ran


async def test_a_small_request_behind_a_large_one_waits_for_one_chunk_of_it():
    backend = RecordingBackend(hold_first_call=True)
    # items of 2 tokens: chunks of 4 items; a call of 8 items' tokens
    batcher = await started(backend, max_chunk_tokens=8, max_batch_tokens=16, batch_window_ms=1)
    big = asyncio.create_task(batcher.submit(ScoreRequest(query="big", items=["x"] * 40)))
    await asyncio.to_thread(backend.entered.wait, 5)
    small = asyncio.create_task(batcher.submit(ScoreRequest(query="small", items=["y"] * 2)))
    await asyncio.sleep(0.02)
    backend.gate.set()
    assert (await asyncio.wait_for(small, 10)).scores == [1.0, 1.0]
    assert not big.done()  # answered while most of the large request is still to run
    assert len((await asyncio.wait_for(big, 10)).results) == 40
    await batcher.stop()
    assert backend.calls[1] == ["big", "small"]  # its next chunk and the newcomer share the next call


async def test_closed_loop_clients_keep_every_engine_call_full():
    """The collapse of issue 25: callers answered by one call come back a few ms apart; the next call waits for
    them (up to the window) instead of going at once with the first one back (the old batcher's calls here: 12,
    then 3 each)."""
    backend = RecordingBackend()
    batcher = await started(backend, batch_window_ms=60_000)
    clients = 12

    async def client(number: int) -> None:
        for round_ in range(4):
            await batcher.submit(ScoreRequest(query=f"c{number}", items=["d"] * 3))
            await asyncio.sleep(0.002 * (number % 4))  # the caller's own work before it sends again

    await asyncio.wait_for(asyncio.gather(*(client(number) for number in range(clients))), 10)
    await batcher.stop()
    sizes = [len(call) for call in backend.calls]
    assert sizes[-3:] == [clients] * 3, sizes


async def test_a_cancelled_caller_leaves_the_queue_and_its_items_never_run():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend, batch_window_ms=1)
    first = asyncio.create_task(batcher.submit(ScoreRequest(query="first", items=["a"])))
    await asyncio.to_thread(backend.entered.wait, 5)
    gone = asyncio.create_task(batcher.submit(ScoreRequest(query="gone", items=["a"] * 3)))
    stays = asyncio.create_task(batcher.submit(ScoreRequest(query="stays", items=["a"])))
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.sleep(0.01)
    assert batcher.queue_depth == 1
    backend.gate.set()
    await asyncio.wait_for(asyncio.gather(first, stays), 10)
    await batcher.stop()
    assert backend.calls == [["first"], ["stays"]]


async def test_a_running_call_stops_once_every_caller_in_it_has_gone():
    backend = StoppableBackend()
    batcher = await started(backend)
    task = asyncio.create_task(batcher.submit(ScoreRequest(query="leaves", items=["a"] * 4)))
    await asyncio.to_thread(backend.entered.wait, 5)
    task.cancel()
    assert await asyncio.to_thread(backend.stopped.wait, 5), "the engine call was not stopped"
    backend.gate.set()
    assert (await asyncio.wait_for(batcher.submit(ScoreRequest(query="next", items=["a"])), 10)).scores == [1.0]
    await batcher.stop()
    assert batcher.metrics.stopped_calls == 1


async def test_a_request_over_max_request_tokens_is_refused_before_it_queues():
    backend = RecordingBackend()
    batcher = await started(backend, max_request_tokens=100)
    with pytest.raises(RequestTooLarge, match="max_request_tokens") as refused:
        await batcher.submit(ScoreRequest(query=[1], items=[[2] * 60, [3] * 60]))
    await batcher.stop()
    assert refused.value.status_code == 413 and refused.value.field == "items" and backend.calls == []


async def test_drain_finishes_queued_work_in_time_and_refuses_new_work():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend, batch_window_ms=1)
    first = asyncio.create_task(batcher.submit(ScoreRequest(query="first", items=["a"])))
    await asyncio.to_thread(backend.entered.wait, 5)
    waiting = asyncio.create_task(batcher.submit(ScoreRequest(query="waiting", items=["a"])))
    await asyncio.sleep(0.01)
    drain = asyncio.create_task(batcher.drain(30))
    await asyncio.sleep(0.01)
    with pytest.raises(ShuttingDown):
        await batcher.submit(ScoreRequest(query="late", items=["a"]))
    backend.gate.set()
    await asyncio.wait_for(drain, 10)
    assert [len((await task).results) for task in (first, waiting)] == [1, 1]
    await batcher.stop()


async def test_drain_answers_work_left_at_its_deadline_with_shutting_down():
    backend = StoppableBackend()
    batcher = await started(backend, batch_window_ms=1)
    running = asyncio.create_task(batcher.submit(ScoreRequest(query="running", items=["a"])))
    await asyncio.to_thread(backend.entered.wait, 5)
    waiting = asyncio.create_task(batcher.submit(ScoreRequest(query="waiting", items=["a"])))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(batcher.drain(0.05), 10)
    for task in (running, waiting):
        with pytest.raises(ShuttingDown, match="drain_seconds"):
            await task
    assert await asyncio.to_thread(backend.stopped.wait, 5), "the running engine call went on"
    await batcher.stop()
    assert backend.calls == [["running"]]


async def test_warm_up_covers_every_token_bucket_a_call_can_reach():
    backend = ShapeRecorder()
    config = ServerConfig(max_batch_tokens=16384, max_chunk_tokens=4096, max_batch_items=64)
    batcher = Batcher(backend, config)
    await batcher.warm_up()
    assert backend.shapes == warm_up_shapes(config)
    # about a power of two of tokens each, from 256 up to the call budget; 64 items at most (the item budget)
    assert [items * (words + WARM_UP_ITEM_OVERHEAD) for items, words in backend.shapes] == [256, 512, 1024, 2048,
                                                                                         4096, 8192, 16384]
    assert max(items for items, _ in backend.shapes) == 64
    await batcher.stop()


async def test_chunks_shrink_to_a_fraction_of_a_second_of_a_slow_engine():
    class Slow(RecordingBackend):
        def _record(self, requests):
            time.sleep(0.05)  # ~1,000 estimated tokens in >= 0.05 s: at most ~20k tokens/s
            super()._record(requests)

    backend = Slow()
    batcher = await started(backend)
    assert batcher.chunk_tokens == 8192  # the most, before the engine's speed is known
    await batcher.submit(ScoreRequest(query=[1], items=[[2] * 99] * 10))
    assert batcher.chunk_tokens in (256, 512)  # 0.05 s of ~20k tokens/s or less, a power of two, 256 at least
    assert batcher.call_tokens == 16 * batcher.chunk_tokens  # a call of ~0.8 s, not max_batch_tokens
    response = await batcher.submit(ScoreRequest(query=[1], items=[[2] * 99] * 12))
    await batcher.stop()
    assert len(backend.requests[-1].items) < 12 and len(response.results) == 12


async def test_a_lone_large_request_runs_its_chunks_back_to_back_without_waiting_for_company():
    backend = RecordingBackend()
    batcher = await started(backend, max_batch_items=2, batch_window_ms=60_000)  # a held call would time out
    response = await asyncio.wait_for(batcher.submit(ScoreRequest(query="big", items=["a"] * 10)), 10)
    await batcher.stop()
    assert len(response.results) == 10 and len(backend.calls) == 5
    assert batcher.metrics.held_calls == 0


async def test_an_item_refused_in_a_chunk_is_named_by_its_index_in_the_whole_request():
    class RefusesTooLong(RecordingBackend):
        def _respond(self, request):
            for index, item in enumerate(request.items):
                if item == "refused":
                    raise RequestTooLarge(f"items[{index}]", "is too long", 10)
            return super()._respond(request)

    batcher = Batcher(RefusesTooLong(), ServerConfig(max_batch_items=2))
    batcher.start()
    with pytest.raises(RequestTooLarge) as refused:  # chunks [0:2] and [2:4]: the refused item is the chunk's 1
        await asyncio.wait_for(batcher.submit(ScoreRequest(query="q", items=["a", "b", "c", "refused"])), 10)
    await batcher.stop()
    assert refused.value.field == "items[3]" and refused.value.limit == 10
    assert refused.value.message == str(refused.value) == "items[3]: is too long"
