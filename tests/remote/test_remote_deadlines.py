"""A call's deadline, a try's timeout and the checks on replies, against misbehaving loopback servers.

Each call must end within its deadline plus ``SLACK`` (a loaded 2-core box), whatever the server does: drip bytes,
hang, fail until the end of time; every item comes back exactly once or the call raises ``RemoteError``.
"""

from __future__ import annotations

import re
import time

import pytest
from fault_server import HUGE_BYTES, expected_scores, items

from rerankit import Reranker
from rerankit.errors import InvalidRequest, RemoteError
from rerankit.remote import RemoteBackend, Timeout
from rerankit.schema import ScoreRequest

SLACK = 1.0
DEADLINE = 0.5
# The try timeout these tests keep out of the way, so that only the deadline can end a call.
LONG = Timeout(connect=2.0, read=30.0)
# A try timeout that a hanging server runs into, with room for a healthy reply on a loaded box.
TRY = Timeout(connect=0.5, read=0.6)
OPTIONS = {"dialect": "vllm-generative", "backoff_base": 0.01, "backoff_max": 0.05}


def request(count: int = 3) -> ScoreRequest:
    return ScoreRequest(query="q", items=items(count), label_token_ids=[1, 2])


async def timed_score(urls, use_async: bool, count: int = 3, **options):
    """(response or the RemoteError raised, seconds the call took)."""
    remote = RemoteBackend(urls, **{**OPTIONS, **options})
    started = time.monotonic()
    try:
        return (await remote.ascore(request(count)) if use_async else remote.score(request(count))), \
            time.monotonic() - started
    except RemoteError as error:
        return error, time.monotonic() - started
    finally:
        await remote.aclose()


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", ["drip", "drip-head", "hang"])
async def test_deadline_ends_a_reply_that_never_completes(servers, fault, use_async):
    server = servers(default=fault)
    error, took = await timed_score(server.url, use_async, deadline=DEADLINE, timeout=LONG)
    assert isinstance(error, RemoteError)
    assert f"deadline of {DEADLINE:g} s passed after 1 tries ({server.url}/generative_scoring)" in str(error)
    assert DEADLINE * 0.9 <= took < DEADLINE + SLACK


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_try_timeout_bounds_the_whole_answer_not_each_read(servers, use_async):
    server = servers(["drip"])
    response, took = await timed_score(server.url, use_async, timeout=TRY)
    assert response.scores == expected_scores(3)
    assert server.hits == 2
    assert TRY.read - 0.05 <= took < TRY.read + SLACK


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_retries_stop_at_the_deadline(servers, use_async):
    server = servers(default="503")
    error, took = await timed_score(server.url, use_async, deadline=DEADLINE, max_retries=1000,
                                    backoff_base=0.1, backoff_max=0.1)
    assert "deadline of 0.5 s passed" in str(error)
    assert server.hits >= 3
    assert took < DEADLINE + SLACK


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_retry_whose_wait_outlasts_the_deadline_is_not_made(servers, use_async):
    server = servers(["429:30"])
    error, took = await timed_score(server.url, use_async, deadline=2.0, backoff_max=60.0)
    # The server said when to come back: its own error, with its Retry-After, rather than a deadline's.
    assert isinstance(error, RemoteError) and "fault 429" in str(error)
    assert error.status_code == 429 and error.retry_after == 30.0
    assert server.hits == 1
    assert took < SLACK


async def test_a_backoff_that_outlasts_the_deadline_fails_with_the_deadline(servers):
    server = servers(["503"])  # no Retry-After: the wait is the client's own
    error, took = await timed_score(server.url, False, deadline=0.5, backoff_base=5.0, backoff_max=5.0)
    assert "deadline of 0.5 s passed after 1 tries" in str(error) and "fault 503" in str(error)
    assert error.status_code == 502 and server.hits == 1
    assert took < SLACK


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_split_requests_share_one_deadline(servers, use_async):
    server = servers(default="hang")
    error, took = await timed_score(server.url, use_async, count=12, deadline=DEADLINE, timeout=LONG,
                                    max_items_per_request=2, max_concurrency=2)
    # The error is that of a request that was sent (not one waiting for a slot): it names the endpoint.
    assert f"deadline of 0.5 s passed after 1 tries ({server.url}/generative_scoring)" in str(error)
    # Six requests two at a time: one deadline for all, not one each.
    assert took < DEADLINE + SLACK


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_an_endpoint_that_times_out_is_set_aside(servers, use_async):
    ok, hanging = servers(), servers(default="hang")
    remote = RemoteBackend([ok.url, hanging.url], **OPTIONS, timeout=TRY)
    took = []
    for _ in range(6):
        started = time.monotonic()
        response = await remote.ascore(request(4)) if use_async else remote.score(request(4))
        took.append(time.monotonic() - started)
        assert response.scores == expected_scores(4)
    await remote.aclose()
    # The second call meets the hanging endpoint, waits out its timeout and fails over; later calls skip it.
    assert hanging.hits == 1 and ok.hits == 6
    assert took[1] >= TRY.read - 0.05
    assert sum(took) < TRY.read + SLACK


def test_an_endpoint_cut_off_by_the_deadline_is_set_aside_too(servers):
    ok, hanging = servers(), servers(default="hang")
    with Reranker([hanging.url, ok.url], **OPTIONS, deadline=0.5, timeout=LONG) as reranker:
        outcomes = []
        for _ in range(4):
            try:
                outcomes.append(len(reranker.rank("q", items(3), label_token_ids=[1, 2])))
            except RemoteError as error:
                outcomes.append(str(error))
    assert "deadline of 0.5 s passed" in outcomes[0]
    assert outcomes[1:] == [3, 3, 3]
    assert hanging.hits == 1


def test_a_set_aside_endpoint_is_tried_again_after_its_cooldown(servers):
    ok, hanging = servers(), servers(["hang"])
    remote = RemoteBackend([hanging.url, ok.url], **OPTIONS, timeout=TRY, dead_cooldown=0.3)
    assert remote.score(request()).scores == expected_scores(3)
    assert (hanging.hits, ok.hits) == (1, 1)
    remote.score(request())
    assert hanging.hits == 1
    time.sleep(0.35)
    for _ in range(2):
        assert remote.score(request()).scores == expected_scores(3)
    remote.close()
    assert hanging.hits == 2


@pytest.mark.parametrize("fault, message", [
    ("nan", "score of item 2 is nan, not a finite number"),
    ("inf", "score of item 2 is inf, not a finite number"),
    ("dup", "index 0 twice"),
    ("missing", "misses items [2] of 3"),
])
async def test_a_reply_that_is_not_one_finite_score_per_item_is_a_remote_error(servers, fault, message):
    server = servers([fault])
    error, _ = await timed_score(server.url, False)
    assert isinstance(error, RemoteError) and message in str(error)
    # A wrong answer is not retried: another try would most likely repeat it.
    assert server.hits == 1


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault, said", [("huge", "passed"), ("huge-announced", "announces")])
async def test_an_oversized_reply_is_refused_while_it_streams(servers, fault, said, use_async):
    server = servers([fault])
    cap = 2**20
    error, took = await timed_score(server.url, use_async, max_response_bytes=cap)
    assert isinstance(error, RemoteError)
    assert f"{said} " in str(error) and f"over max_response_bytes={cap:,}" in str(error)
    assert server.hits == 1
    # The client stopped reading: the server got no further than what the socket buffers hold.
    time.sleep(0.1)
    assert server.sent < HUGE_BYTES // 2


@pytest.mark.parametrize("option, value", [
    ("deadline", 0), ("deadline", -1.0), ("max_response_bytes", 0), ("deadline", float("inf")), ("deadline", 1e10),
    ("deadline", float("nan")), ("deadline", "10"), ("timeout", None), ("timeout", float("inf")),
    ("timeout", 1e10), ("max_retries", None), ("max_retries", 1.5),
    ("max_items_per_request", 2.5), ("max_concurrency", True), ("backoff_base", -1), ("dead_cooldown", "x"),
    ("api_key", "clé"), ("api_key", 123),
])
def test_bad_reliability_options_name_the_field(option, value):
    with pytest.raises(InvalidRequest, match=option):
        RemoteBackend("http://127.0.0.1:1", **{option: value})


@pytest.mark.parametrize("field, value", [("read", float("inf")), ("connect", 0), ("read", "5")])
def test_a_bad_timeout_names_its_part(field, value):
    with pytest.raises(InvalidRequest, match=f"timeout.{field}"):
        Timeout(**{field: value})


def test_the_langchain_adapter_passes_the_deadline_to_its_backend(servers):
    from langchain_core.documents import Document

    from rerankit.integrations.langchain import RerankitRerank

    server = servers(default="hang")
    compressor = RerankitRerank(model=server.url, backend_options={**OPTIONS, "deadline": 0.5, "timeout": LONG},
                                request_options={"label_token_ids": [1, 2]})

    started = time.monotonic()
    with pytest.raises(RemoteError, match="deadline of 0.5 s"):
        compressor.compress_documents([Document(page_content=text) for text in items(3)], "q")
    assert time.monotonic() - started < 0.5 + SLACK



@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_waiting_for_a_request_slot_does_not_count_against_a_try(servers, use_async):
    server = servers(delays=(0.1, 0.1))
    # Ten requests one at a time take ~1 s: past each try's 0.6 s, well within the deadline.
    response, _ = await timed_score(server.url, use_async, count=10, timeout=TRY, deadline=10.0,
                                    max_items_per_request=1, max_concurrency=1)
    assert response.scores == expected_scores(10)
    assert server.hits == 10


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_probe_that_outlasts_the_deadline_names_the_deadline(servers, use_async):
    """A discovery GET to a server that never answers ends at the deadline, with discovery's error naming the URL,
    what went wrong and the deadline (the GET itself does not retry)."""
    from collections import deque

    far = servers()
    far.probes = deque(["hang"])
    error, took = await timed_score(far.url, use_async, deadline=0.3, timeout=Timeout(read=5.0), dialect=None)
    assert isinstance(error, RemoteError), error
    assert re.fullmatch(rf"cannot reach {far.url} to discover its dialect \(no complete answer within 0\.3 s\), "
                        r"1 try in 0\.\d s \(deadline 0\.3 s\): is the server up\?", str(error)), str(error)
    assert took < 0.3 + SLACK and far.gets == ["/openapi.json"]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", ["gzip-ok", "deflate-ok", "raw-deflate-ok"])
async def test_a_compressed_reply_is_inflated(servers, fault, use_async):
    server = servers([fault])
    response, _ = await timed_score(server.url, use_async)
    assert response.scores == expected_scores(3)
    assert server.posts[0][0]["accept-encoding"] == "gzip, deflate"  # never br or zstd, whatever is installed


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", ["gzip-bomb", "deflate-bomb"])
async def test_a_compressed_reply_is_inflated_no_further_than_the_cap(servers, fault, use_async):
    import tracemalloc

    server = servers([fault])  # 64 MiB of spaces in ~64 KB
    cap = 2**20
    tracemalloc.start()
    try:
        error, _ = await timed_score(server.url, use_async, max_response_bytes=cap)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(error, RemoteError) and f"over max_response_bytes={cap:,}" in str(error), error
    assert peak < 8 * cap, peak
    assert server.hits == 1


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_reply_compressed_as_the_client_did_not_ask_is_a_remote_error(servers, use_async):
    server = servers(["zstd-bomb"])
    error, _ = await timed_score(server.url, use_async)
    assert isinstance(error, RemoteError) and "compressed as 'zstd'" in str(error), error


@pytest.mark.parametrize("deadline", [None, 10.0])
async def test_closing_the_backend_ends_a_split_call_in_flight_promptly(servers, deadline):
    import threading

    from rerankit.errors import RerankitError

    server = servers(default="slow")
    remote = RemoteBackend(server.url, **OPTIONS, deadline=deadline, max_items_per_request=1, max_concurrency=1)
    outcome = []

    def call():
        try:
            outcome.append(remote.score(request(4)))
        except Exception as error:  # noqa: BLE001 - the test reads what came out
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    time.sleep(0.2)
    started = time.monotonic()
    remote.close()
    caller.join(10)
    assert not caller.is_alive(), "the call still waits after close()"
    assert time.monotonic() - started < 2 + SLACK
    assert isinstance(outcome[0], RerankitError) and "closed" in str(outcome[0]), repr(outcome[0])


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_asyncio_run_per_call_leaves_no_connection_open(servers):
    import asyncio
    import gc
    import os

    server = servers()
    remote = RemoteBackend(server.url, **OPTIONS)
    gc.disable()  # the connections must be closed by the client, not by the collector
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(10):
            assert asyncio.run(remote.ascore(request())).scores == expected_scores(3)
        assert len(os.listdir("/proc/self/fd")) <= before + 1
    finally:
        gc.enable()
        remote.close()


def test_a_failed_sync_split_call_ends_its_other_requests_in_flight(servers):
    """One request of a split call is refused: the call raises at once, and its other requests, which the far
    server holds unanswered, are dropped (their connections closed) rather than read to the deadline."""
    server = servers(["400", "hold", "hold", "hold"])
    remote = RemoteBackend(server.url, **OPTIONS, deadline=10.0, timeout=LONG, max_items_per_request=1,
                           max_concurrency=4)
    started = time.monotonic()
    with pytest.raises(RemoteError, match="400"):
        remote.score(request(4))
    assert time.monotonic() - started < 2 + SLACK
    ended = time.monotonic() + 3
    while server.abandoned < 3 and time.monotonic() < ended:
        time.sleep(0.02)
    assert server.abandoned == 3, (server.hits, server.abandoned)
    remote.close()
