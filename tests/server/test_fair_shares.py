"""Fair shares between callers and request priorities (``server/scheduler.py``): a caller that floods the queue gets
one share, as a caller with one request does; a lower ``priority`` (vLLM's and Cohere's field) goes first, and
under a full queue takes the place of queued work of a higher number; who the caller is (``limits.caller_of``).
In the queue itself, through the batcher, and over HTTP with real clients' bodies."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from live_server import live_server
from server_fakes import RecordingBackend

from rerankit.schema import ScoreRequest
from rerankit.server.app import create_app
from rerankit.server.batcher import Batcher
from rerankit.server.limits import ServerConfig, caller_of
from rerankit.errors import Overloaded
from rerankit.server.scheduler import FairQueue, Submission, split


def queued(queue: FairQueue, query: str, tokens: list[int], caller: str = "", priority: int = 0) -> Submission:
    request = ScoreRequest(query=query, items=["d"] * len(tokens), priority=priority)
    submission = Submission(request, split(tokens, 1_000, 512), asyncio.get_running_loop().create_future(),
                            caller=caller)
    queue.add(submission)
    return submission


def owners(queue: FairQueue, max_items: int) -> list[str]:
    return [piece.submission.request.query for piece in queue.take(max_items, 1_000_000)]


async def busy(**config) -> tuple[RecordingBackend, Batcher, asyncio.Task]:
    """A started batcher whose engine holds its first call ("first") until ``backend.gate`` is set."""
    backend = RecordingBackend(hold_first_call=True)
    batcher = Batcher(backend, ServerConfig(batch_window_ms=0, **config))
    batcher.start()
    first = asyncio.create_task(batcher.submit(ScoreRequest(query="first", items=["x"])))
    await asyncio.to_thread(backend.entered.wait, 5)
    return backend, batcher, first


async def test_a_caller_that_floods_the_queue_gets_one_share_and_a_lone_caller_the_next_turn():
    queue = FairQueue()
    for number in range(10):
        queued(queue, f"a{number}", [10], caller="a")
    queued(queue, "b0", [10], caller="b")
    assert owners(queue, 3) == ["a0", "b0", "a1"]  # per request, b0 would wait behind all ten
    assert owners(queue, 3) == ["a2", "a3", "a4"]


async def test_callers_take_turns_by_tokens_served_and_each_callers_requests_by_their_own():
    queue = FairQueue()
    queued(queue, "a-big", [10] * 3, caller="a")  # one chunk of 30 tokens
    queued(queue, "b0", [10], caller="b")
    queued(queue, "b1", [10], caller="b")
    queued(queue, "c0", [10], caller="c")
    # a is served 30 tokens first; then b and c, level at 10 each, take turns before a's next request
    queued(queue, "a-next", [10], caller="a")
    assert owners(queue, 512) == ["a-big", "b0", "c0", "b1", "a-next"]


async def test_a_caller_that_went_idle_comes_back_level_with_the_queue_not_ahead_of_it():
    queue = FairQueue()
    queued(queue, "a-only", [10] * 100, caller="a")
    owners(queue, 512)  # a alone: served 1,000 tokens, then idle
    for number in range(3):
        queued(queue, f"b{number}", [10], caller="b")
    assert owners(queue, 1) == ["b0"]  # b's share grows past what c starts at
    queued(queue, "a-back", [10], caller="a")
    queued(queue, "c0", [10], caller="c")
    assert owners(queue, 3)[:2] == ["b1", "a-back"]  # a banked nothing while idle; c, newer, comes after it


async def test_a_lower_priority_goes_first_whoever_asks_and_ties_keep_the_fair_order():
    queue = FairQueue()
    queued(queue, "batch-job", [10], caller="a", priority=10)
    queued(queue, "batch-job-2", [10], caller="a", priority=10)
    queued(queue, "search", [10], caller="a", priority=0)
    queued(queue, "other-search", [10], caller="b", priority=0)
    queued(queue, "urgent", [10], caller="b", priority=-1)
    assert owners(queue, 1) == ["urgent"]
    assert owners(queue, 2) == ["search", "other-search"]
    assert owners(queue, 2) == ["batch-job", "batch-job-2"]


async def test_the_batcher_queues_by_priority_and_caller_while_the_engine_is_busy():
    backend, batcher, first = await busy(max_batch_items=2)
    waiting = [asyncio.create_task(batcher.submit(ScoreRequest(query=query, items=["x"], priority=priority), caller))
               for query, priority, caller in (("a0", 0, "a"), ("a1", 0, "a"), ("a2", 0, "a"), ("b-low", 5, "b"),
                                               ("b0", 0, "b"))]
    await asyncio.sleep(0.05)
    backend.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *waiting), 10)
    await batcher.stop()
    assert backend.calls == [["first"], ["a0", "b0"], ["a1", "a2"], ["b-low"]]


def test_the_caller_is_the_named_header_else_one_of_several_keys_else_the_client_address():
    plain = ServerConfig()
    assert caller_of(plain, {}, None, "10.0.0.7") == "client:10.0.0.7"
    headed = ServerConfig(caller_header="X-Tenant")
    assert caller_of(headed, {"X-Tenant": "search-team"}, None, "10.0.0.7") == "header:search-team"
    assert caller_of(headed, {"X-Tenant": "has spaces"}, None, "10.0.0.7") == "client:10.0.0.7"  # unusable: ignored
    keyed = ServerConfig(api_key=("key-one", "key-two"))
    assert caller_of(keyed, {}, 1, "10.0.0.7") == "key:1"  # never the key itself
    assert caller_of(ServerConfig(api_key="only-key"), {}, 0, "10.0.0.7") == "client:10.0.0.7"


@pytest.fixture
def held():
    backend = RecordingBackend(hold_first_call=True)
    config = ServerConfig(max_batch_items=2, batch_window_ms=0, caller_header="X-Tenant")
    with live_server(create_app(backend, config)) as url:
        yield backend, url


async def test_over_http_a_tenants_flood_does_not_hold_up_another_and_cohere_priority_counts(held):
    backend, url = held
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        first = asyncio.create_task(client.post("/rerank", json={"query": "first", "documents": ["x"]}))
        await asyncio.to_thread(backend.entered.wait, 5)
        sent = []
        for number in range(4):  # the indexing job: four vLLM rerank requests at once
            sent.append(asyncio.create_task(client.post("/rerank", headers={"X-Tenant": "indexer"},
                                                        json={"query": f"index{number}", "documents": ["x"]})))
        await asyncio.sleep(0.05)
        # Cohere's SDK body (ClientV2.rerank): a backfill at priority 3, then the search tenant's query
        cohere = {"model": "m", "documents": ["x"], "priority": 3}
        sent.append(asyncio.create_task(client.post("/v2/rerank", headers={"X-Tenant": "search"},
                                                    json={**cohere, "query": "backfill"})))
        await asyncio.sleep(0.05)
        sent.append(asyncio.create_task(client.post("/v2/rerank", headers={"X-Tenant": "search"},
                                                    json={**cohere, "query": "user-query", "priority": 0})))
        await asyncio.sleep(0.1)
        backend.gate.set()
        replies = await asyncio.gather(first, *sent)
    assert [reply.status_code for reply in replies] == [200] * 7
    # the indexer's four arrive in any order
    calls = [[query.rstrip("0123456789") for query in call] for call in backend.calls]
    assert calls == [["first"], ["index", "user-query"], ["index", "index"], ["index", "backfill"]]


async def test_under_a_full_queue_a_lower_priority_number_takes_the_place_of_the_newest_highest():
    """max_queue_requests reached: a priority-0 newcomer sheds the newest queued request of the highest priority
    number (none of its chunks run yet), which is answered Overloaded (429); a newcomer no queued request yields
    to is refused itself; the route's check before the body is read lets a request through while some queued
    request has a priority above 0."""
    backend, batcher, first = await busy(max_queue_requests=2, max_batch_items=1)

    def submitted(query: str, priority: int) -> asyncio.Task:
        return asyncio.create_task(batcher.submit(ScoreRequest(query=query, items=["x"], priority=priority), "c"))

    older, newer = submitted("batch-older", 5), submitted("batch-newer", 5)
    await asyncio.sleep(0.02)
    batcher.admit()  # full, but batch work could make room
    urgent = submitted("urgent", 0)
    await asyncio.sleep(0.02)
    with pytest.raises(Overloaded, match="took this one's place"):
        await newer
    late = submitted("batch-late", 5)
    with pytest.raises(Overloaded, match="max_queue_requests"):
        await late
    backend.gate.set()
    await asyncio.wait_for(asyncio.gather(first, older, urgent), 10)
    await batcher.stop()
    assert [call[0] for call in backend.calls] == ["first", "urgent", "batch-older"]
    assert batcher.metrics.shed == 1


async def test_a_queue_full_of_priority_0_work_refuses_before_the_body_is_read():
    backend, batcher, first = await busy(max_queue_requests=1)
    queued_one = asyncio.create_task(batcher.submit(ScoreRequest(query="q", items=["x"])))
    await asyncio.sleep(0.02)
    with pytest.raises(Overloaded):
        batcher.admit()
    backend.gate.set()
    await asyncio.wait_for(asyncio.gather(first, queued_one), 10)
    await batcher.stop()


def test_over_http_the_shed_request_gets_a_429_with_retry_after_in_its_dialect():
    backend = RecordingBackend(hold_first_call=True)
    config = ServerConfig(max_queue_requests=1, batch_window_ms=0)
    with live_server(create_app(backend, config)) as url:
        replies: dict[str, httpx.Response] = {}

        def post(name: str, path: str, body: dict) -> None:
            replies[name] = httpx.post(url + path, json=body, timeout=20)

        threads = [threading.Thread(target=post, args=("first", "/rerank", {"query": "first", "documents": ["x"]}))]
        threads[0].start()
        assert backend.entered.wait(10)
        cohere = {"model": "m", "documents": ["x"]}
        for name, body in (("backfill", {**cohere, "query": "backfill", "priority": 7}),
                           ("search", {**cohere, "query": "search"})):
            threads.append(threading.Thread(target=post, args=(name, "/v2/rerank", body)))
            threads[-1].start()
            time.sleep(0.1)
        threads[1].join(10)  # the backfill, shed by the search query
        backend.gate.set()
        for thread in threads:
            thread.join(20)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    assert replies["backfill"].status_code == 429 and replies["backfill"].headers["retry-after"] == "1"
    assert "took this one's place" in replies["backfill"].json()["message"]  # Cohere's error body
    assert replies["search"].status_code == 200 and replies["first"].status_code == 200
    assert "rerankit_shed_total 1" in metrics
