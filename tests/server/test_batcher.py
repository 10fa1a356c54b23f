"""The batcher against a fake backend that records the engine calls it gets (no model needed)."""

from __future__ import annotations

import asyncio
import time

import pytest

from server_fakes import RecordingBackend

from rerankit.errors import InvalidRequest, Overloaded, ShuttingDown
from rerankit.schema import ScoreRequest, ScoreResponse, ScoreResult
from rerankit.server.batcher import Batcher, estimate_tokens
from rerankit.server.limits import ServerConfig


def request(query: str, items: int = 1) -> ScoreRequest:
    return ScoreRequest(query=query, items=["doc"] * items)


async def started(backend: RecordingBackend, **config: object) -> Batcher:
    batcher = Batcher(backend, ServerConfig(**config))
    batcher.start()
    return batcher


async def queued_behind_first_call(backend: RecordingBackend, batcher: Batcher, queued: list[ScoreRequest],
                                   settle_s: float = 0.05) -> tuple[asyncio.Task, list[asyncio.Task]]:
    """Submit "first", wait until the backend holds it on its gate, then submit ``queued`` behind it.

    Returns the tasks of "first" and of the queued requests, ``settle_s`` after the last one was submitted.
    """
    first = asyncio.create_task(batcher.submit(request("first")))
    await asyncio.to_thread(backend.entered.wait, 5)
    tasks = [asyncio.create_task(batcher.submit(queued_request)) for queued_request in queued]
    await asyncio.sleep(settle_s)
    return first, tasks


async def test_lone_request_on_idle_engine_is_not_held_for_the_window():
    backend = RecordingBackend()
    batcher = await started(backend, batch_window_ms=60_000)  # a held request would time out below
    response = await asyncio.wait_for(batcher.submit(request("q")), 10)
    await batcher.stop()
    assert response.scores == [3.0]
    assert backend.calls == [["q"]]
    assert batcher.metrics.held_calls == 0


async def test_requests_arriving_while_the_engine_runs_share_the_next_call():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend, batch_window_ms=1)
    first, others = await queued_behind_first_call(backend, batcher, [request(f"q{n}") for n in range(5)])
    assert batcher.queue_depth == 5
    backend.gate.set()
    responses = await asyncio.gather(first, *others)
    await batcher.stop()
    assert backend.calls == [["first"], ["q0", "q1", "q2", "q3", "q4"]]
    assert all(response.scores == [3.0] for response in responses)
    assert batcher.metrics.batches == 2


async def test_batch_item_budget_splits_the_queue_in_arrival_order():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend, batch_window_ms=1, max_batch_items=4)
    first, others = await queued_behind_first_call(backend, batcher, [request(f"q{n}", items=2) for n in range(5)])
    backend.gate.set()
    await asyncio.gather(first, *others)
    await batcher.stop()
    assert backend.calls == [["first"], ["q0", "q1"], ["q2", "q3"], ["q4"]]


async def test_merged_call_failing_as_a_whole_is_retried_one_request_at_a_time():
    class FailsMerged(RecordingBackend):
        def score_batch(self, requests, *, return_exceptions=False):
            self._record(requests)
            raise RuntimeError("out of memory")

    backend = FailsMerged(hold_first_call=True)
    batcher = await started(backend, batch_window_ms=1)
    first, others = await queued_behind_first_call(backend, batcher, [request(f"q{n}") for n in range(2)])
    backend.gate.set()
    responses = await asyncio.gather(first, *others)
    await batcher.stop()
    assert [response.scores for response in responses] == [[3.0]] * 3
    assert backend.calls == [["first"], ["q0", "q1"], ["q0"], ["q1"]]


async def test_request_over_the_item_budget_runs_in_chunks_and_comes_back_whole():
    backend = RecordingBackend()
    batcher = await started(backend, max_batch_items=2)
    big = ScoreRequest(query="big", items=["a" * n for n in range(1, 6)])
    response = await batcher.submit(big)
    await batcher.stop()
    assert [len(chunk.items) for chunk in backend.requests] == [2, 2, 1]
    assert [result.index for result in response.results] == [0, 1, 2, 3, 4]
    assert response.scores == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert response.usage.prompt_tokens == 15


async def test_bad_request_in_a_merged_call_fails_only_its_own_caller():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend, batch_window_ms=1)
    first, (good, bad) = await queued_behind_first_call(backend, batcher, [request("good"), request("bad")])
    backend.gate.set()
    await first
    assert (await good).scores == [3.0]
    with pytest.raises(InvalidRequest):
        await bad
    await batcher.stop()
    assert backend.calls[1:] == [["good", "bad"]]  # one call; the bad request got its own error back


async def test_full_queue_refuses_with_overloaded_and_keeps_serving():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend, max_queue_requests=2)
    first, queued = await queued_behind_first_call(backend, batcher, [request(f"q{n}") for n in range(2)],
                                                   settle_s=0.02)
    with pytest.raises(Overloaded, match="max_queue_requests"):
        await batcher.submit(request("one too many"))
    backend.gate.set()
    await asyncio.gather(first, *queued)
    assert (await batcher.submit(request("later"))).scores == [3.0]
    await batcher.stop()


async def test_no_batching_scores_one_request_per_engine_call():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend, batching=False)
    first, others = await queued_behind_first_call(backend, batcher, [request(f"q{n}") for n in range(3)])
    backend.gate.set()
    await asyncio.gather(first, *others)
    await batcher.stop()
    assert backend.calls == [["first"], ["q0"], ["q1"], ["q2"]]


async def test_sequential_lone_requests_are_never_held_for_the_window():
    backend = RecordingBackend()
    batcher = await started(backend, batch_window_ms=60_000)  # a held request would time out below
    for number in range(3):
        await asyncio.wait_for(batcher.submit(request(f"q{number}")), 10)
    await batcher.stop()
    assert backend.calls == [["q0"], ["q1"], ["q2"]]
    assert batcher.metrics.held_calls == 0


async def test_request_queued_behind_a_call_waits_out_the_window_for_company():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend, batch_window_ms=300)
    first, (queued,) = await queued_behind_first_call(backend, batcher, [request("queued")], settle_s=0.01)
    backend.gate.set()
    await first
    late = asyncio.create_task(batcher.submit(request("late")))  # a caller answered by the first call
    await asyncio.gather(queued, late)
    await batcher.stop()
    assert backend.calls == [["first"], ["queued", "late"]]


async def test_stop_fails_queued_requests_instead_of_leaving_them_waiting():
    backend = RecordingBackend(hold_first_call=True)
    batcher = await started(backend)
    first, (queued,) = await queued_behind_first_call(backend, batcher, [request("queued")], settle_s=0.02)
    backend.gate.set()
    await batcher.stop()
    results = await asyncio.gather(first, queued, return_exceptions=True)
    assert any(isinstance(result, ShuttingDown) for result in results)


def test_token_estimate_is_exact_for_ids_and_bytes_over_four_for_text():
    assert estimate_tokens(ScoreRequest(query=[1, 2], items=[[3, 4, 5], [6]])) == (2 + 3) + (2 + 1)
    assert estimate_tokens(ScoreRequest(query="abcdefgh", items=["x" * 40])) == 2 + 10
    assert estimate_tokens(ScoreRequest(query="abcd", items=["x" * 400], max_tokens_per_item=7)) == 1 + 7


class TwoReplicaBackend(RecordingBackend):
    """A data-parallel backend of two replicas (or, with ``pipelined``, one GPU that overlaps two calls): each call
    waits on the gate until both calls are in."""

    def __init__(self, pipelined: bool = False) -> None:
        if pipelined:
            self.pipelined_calls = 2
        else:
            self.data_parallel_size = 2
        super().__init__(hold_first_call=True)
        self.inside = 0
        self.most_inside = 0

    def _record(self, requests):
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        if self.inside == 2:
            self.gate.set()
        try:
            super()._record(requests)
        finally:
            self.inside -= 1


@pytest.mark.parametrize("pipelined", [False, True], ids=["data-parallel", "pipelined"])
async def test_a_backend_taking_two_calls_gets_two_engine_calls_at_once(pipelined):
    backend = TwoReplicaBackend(pipelined)
    batcher = await started(backend, batch_window_ms=1)
    first = asyncio.create_task(batcher.submit(request("first")))
    await asyncio.to_thread(backend.entered.wait, 5)
    second = await asyncio.wait_for(batcher.submit(request("second")), 10)  # runs while "first" is held
    assert (await asyncio.wait_for(first, 10)).scores == second.scores == [3.0]
    await asyncio.wait_for(batcher.drain(5), 10)  # idle once both calls ended
    await batcher.stop()
    assert backend.most_inside == 2 and sorted(backend.calls) == [["first"], ["second"]]


class ProxyBackend:
    """Like a ``RemoteBackend``: ``score``/``async ascore`` only; holds each call until ``max_concurrency`` calls
    are inside. ``hold=True``: holds every call until it is cancelled (a far server that never answers)."""

    model_name = "proxy"
    max_concurrency = 3

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.all_inside = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.inside = self.most_inside = 0
        self.requests: list[ScoreRequest] = []

    def score(self, request: ScoreRequest):
        raise AssertionError("a backend with a coroutine ascore is awaited, never called on a thread")

    async def ascore(self, request: ScoreRequest):
        self.requests.append(request)
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        if self.inside == self.max_concurrency:
            self.all_inside.set()
        try:
            if self.hold:
                await asyncio.Event().wait()
            await asyncio.wait_for(self.all_inside.wait(), 5)
            return ScoreResponse(model=self.model_name,
                                 results=[ScoreResult(index=i, score=1.0) for i in range(len(request.items))])
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.inside -= 1


async def test_a_backend_without_score_batch_gets_whole_requests_several_calls_at_once():
    backend = ProxyBackend()
    batcher = await started(backend, max_chunk_tokens=256, max_batch_items=4)
    big = ScoreRequest(query="big", items=["word " * 100] * 20)  # many chunks' worth, for a local engine
    tasks = [batcher.submit(big), batcher.submit(request("a")), batcher.submit(request("b"))]
    responses = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await batcher.stop()
    assert backend.most_inside == 3  # all three in flight together, none waited for another
    assert len(responses[0].results) == 20
    assert sorted(len(r.items) for r in backend.requests) == [1, 1, 20]  # one request a call, never cut


async def proxied_call_in_flight() -> tuple[ProxyBackend, Batcher, asyncio.Task]:
    """A batcher over a far server that never answers, with one caller's request inside it."""
    backend = ProxyBackend(hold=True)
    batcher = await started(backend)
    caller = asyncio.create_task(batcher.submit(request("held")))
    while not backend.inside:
        await asyncio.sleep(0.01)
    return backend, batcher, caller


async def test_a_proxied_request_is_cancelled_upstream_as_soon_as_its_caller_goes():
    backend, batcher, caller = await proxied_call_in_flight()
    caller.cancel()  # the route does this when its client disconnects
    await asyncio.wait_for(backend.cancelled.wait(), 2)  # the far call is cancelled, not left to its deadline
    assert backend.inside == 0
    for _ in range(100):  # the call slot comes back
        if batcher.metrics.stopped_calls:
            break
        await asyncio.sleep(0.01)
    assert batcher.metrics.stopped_calls == 1
    backend.hold = False
    backend.max_concurrency = 1  # one call inside is all it waits for now
    answered = await asyncio.wait_for(batcher.submit(request("stays")), 5)
    assert answered.scores == [1.0]
    await batcher.stop()


async def test_stop_cancels_a_proxied_request_in_flight_and_answers_shutting_down():
    backend, batcher, caller = await proxied_call_in_flight()
    await asyncio.wait_for(batcher.stop(), 5)
    assert backend.cancelled.is_set()
    with pytest.raises(ShuttingDown):
        await caller


class SlowOrBadBackend(RecordingBackend):
    """Takes a while over "slow"; refuses "bad" at once (``RecordingBackend``'s rule)."""

    def score(self, request):
        if request.query == "slow":
            time.sleep(0.2)
        return super().score(request)


async def test_pieces_that_fail_at_once_do_not_count_toward_the_engine_speed():
    batcher = await started(SlowOrBadBackend(), batch_window_ms=1, max_chunk_tokens=8192)
    await batcher.submit(ScoreRequest(query="slow", items=["word " * 20] * 4))  # ~100 tokens in 0.2 s or more
    slow_budget = batcher.chunk_tokens
    assert slow_budget == 256
    with pytest.raises(InvalidRequest):
        await batcher.submit(ScoreRequest(query="bad", items=["word " * 200] * 40))  # thousands of tokens, no time
    assert batcher.chunk_tokens == slow_budget
    await batcher.stop()


class ShortCountBackend(RecordingBackend):
    """A broken engine: returns one outcome fewer than the requests it was given, and results past the items."""

    def score_batch(self, requests, *, return_exceptions=False):
        return super().score_batch(requests, return_exceptions=return_exceptions)[:-1]

    def score(self, request):
        response = super().score(request)
        if request.query == "overshoot":
            response.results[0].index = 99
        return response


async def test_an_engine_that_returns_too_few_outcomes_fails_its_callers_and_the_server_serves_on():
    backend = ShortCountBackend(hold_first_call=True)
    batcher = await started(backend, batch_window_ms=200, max_batch_items=2)
    first, queued = await queued_behind_first_call(backend, batcher, [request("a"), request("b")])
    backend.gate.set()
    await asyncio.wait_for(first, 10)
    for task in queued:  # merged into one call that came back one outcome short: both answered, with an error
        with pytest.raises(RuntimeError, match="1 outcomes for 2 requests"):
            await asyncio.wait_for(task, 10)
    # A failure after the engine returned (a result naming an item 99 of a chunked request) fails its caller only.
    with pytest.raises(RuntimeError, match="did not return a score for every item"):
        await asyncio.wait_for(batcher.submit(ScoreRequest(query="overshoot", items=["doc"] * 3)), 10)
    assert (await asyncio.wait_for(batcher.submit(request("after")), 10)).scores == [3.0]
    await batcher.stop()


async def test_stop_waits_for_the_running_call_without_blocking_the_event_loop():
    class Leaving(RecordingBackend):
        inside = False

        def _record(self, requests):
            self.inside = True
            try:
                super()._record(requests)
            finally:
                self.inside = False

    backend = Leaving(hold_first_call=True)
    batcher = await started(backend)
    running = asyncio.create_task(batcher.submit(request("first")))
    await asyncio.to_thread(backend.entered.wait, 5)
    seen_inside = []

    def release() -> None:  # runs on the loop: only while stop() is waiting off the loop can it run this early
        seen_inside.append(backend.inside)
        backend.gate.set()

    asyncio.get_running_loop().call_later(0.05, release)
    await asyncio.wait_for(batcher.stop(), 20)
    assert seen_inside == [True]
    with pytest.raises(ShuttingDown):
        await running
