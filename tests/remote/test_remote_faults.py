"""The transport's retries and failover against real sockets on 127.0.0.1 (fault_server.py): resets, closes and
slow replies, HTTP errors with ``Retry-After``, refused connections, split requests."""

from __future__ import annotations

import time

import pytest
from fault_server import expected_scores, items

from rerankit.errors import RemoteError
from rerankit.remote import RemoteBackend, Timeout
from rerankit.schema import ScoreRequest

# A try's timeout bounds its whole answer: room for a healthy reply on a loaded box, less than SLOW_SECONDS.
READ_TIMEOUT = 0.5
FAST = {"timeout": Timeout(connect=0.5, read=READ_TIMEOUT), "backoff_base": 0.01, "backoff_max": 2.0}


def score(urls, count: int = 3, **options):
    options = {**FAST, "dialect": "vllm-generative", **options}
    with RemoteBackend(urls, **options) as remote:
        return remote.score(ScoreRequest(query="q", items=items(count), label_token_ids=[1, 2]))


def test_connection_refused_is_retried_then_raises(dead_url):
    started = time.monotonic()
    with pytest.raises(RemoteError, match=r"ConnectError.*3 tries"):
        score(dead_url, max_retries=2)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("fault", ["reset", "cut"])
def test_a_connection_reset_or_closed_mid_body_is_retried(servers, fault):
    server = servers([fault])
    assert score(server.url).scores == expected_scores(3)
    assert server.hits == 2


def test_read_timeout_is_retried(servers):
    server = servers(["slow"])
    assert score(server.url).scores == expected_scores(3)
    assert server.hits == 2


def test_read_timeout_without_retries_raises(servers):
    server = servers(["slow"])
    with pytest.raises(RemoteError, match=r"no complete answer within 0.5 s"):
        score(server.url, max_retries=0)
    assert server.hits == 1


def test_429_waits_for_retry_after(servers):
    server = servers(["429:1"])
    started = time.monotonic()
    assert score(server.url).scores == expected_scores(3)
    assert time.monotonic() - started >= 0.95
    assert server.hits == 2


def test_503_then_success(servers):
    server = servers(["503", "503"])
    assert score(server.url).scores == expected_scores(3)
    assert server.hits == 3


def test_5xx_past_the_retry_budget_raises_with_the_status(servers):
    server = servers(["503"] * 5)
    with pytest.raises(RemoteError, match="fault 503") as failed:
        score(server.url, max_retries=2)
    assert failed.value.status_code == 503 and server.hits == 3


def test_a_429_past_the_retry_budget_keeps_the_last_retry_after(servers):
    server = servers(["429:7", "429:2"])
    with pytest.raises(RemoteError, match="fault 429") as failed:
        score(server.url, max_retries=1, backoff_max=0.05)  # waits 0.05 s, not the 7 s asked
    assert failed.value.status_code == 429 and failed.value.retry_after == 2.0 and server.hits == 2


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_a_retry_after_that_is_no_number_of_seconds_is_ignored(servers, value):
    server = servers([f"503:{value}"])
    with pytest.raises(RemoteError, match="fault 503") as failed:
        score(server.url, max_retries=0)
    assert failed.value.status_code == 503 and failed.value.retry_after is None


def test_400_is_not_retried(servers):
    server = servers(["400"])
    with pytest.raises(RemoteError, match="fault 400") as failed:
        score(server.url)
    assert failed.value.status_code == 400 and server.hits == 1


def test_dead_endpoint_is_skipped_and_results_stay_complete_and_ordered(servers, dead_url):
    live = servers()
    started = time.monotonic()
    response = score([dead_url, live.url], count=10, max_items_per_request=2, max_retries=1)
    assert response.scores == expected_scores(10)
    assert live.hits == 5
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("use_async", [False, True])
async def test_split_requests_run_concurrently_and_reassemble_in_order(servers, use_async):
    server = servers(delays=(0.05, 0.12))
    options = {**FAST, "timeout": Timeout(connect=0.5, read=2.0), "dialect": "vllm-generative",
               "max_items_per_request": 4, "max_concurrency": 3}
    request = ScoreRequest(query="q", items=items(23), label_token_ids=[1, 2])
    remote = RemoteBackend(server.url, **options)
    response = await remote.ascore(request) if use_async else remote.score(request)
    await remote.aclose()
    assert response.scores == expected_scores(23)
    assert response.usage.prompt_tokens == 23
    assert server.hits == 6
    assert 2 <= server.max_in_flight <= 3


async def test_async_fails_over_and_retries(servers, dead_url):
    live = servers(["503"])
    remote = RemoteBackend([dead_url, live.url], **FAST, dialect="vllm-generative")
    response = await remote.ascore(ScoreRequest(query="q", items=items(4), label_token_ids=[1]))
    await remote.aclose()
    assert response.scores == expected_scores(4)
    assert live.hits == 2


def test_failover_is_immediate_but_a_full_round_of_failures_backs_off(servers):
    first, second = servers(["503", "503"]), servers(["503"])
    started = time.monotonic()
    response = score([first.url, second.url], max_retries=3, backoff_base=0.2)
    elapsed = time.monotonic() - started
    assert response.scores == expected_scores(3)
    assert (first.hits, second.hits) == (2, 2)
    # first -> second at once; then two backoffs: retry 2 waits >= 0.2 s, retry 3 >= 0.4 s.
    assert 0.6 <= elapsed < 2.0
