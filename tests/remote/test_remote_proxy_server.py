"""``rerankit serve --model http://...`` (a ``RemoteBackend`` behind the server) against a real far server on
loopback: a client that leaves takes its request to the far server with it; a busy far server's ``Retry-After``
reaches the client; the proxy's ``/health`` follows the far server's."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from live_server import live_server

from rerankit.remote import RemoteBackend
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

BODY = {"model": "fault-model", "query": "q", "items": ["doc 0", "doc 1"], "label_token_ids": [1, 2]}


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_client_that_leaves_closes_the_proxied_request_to_the_far_server(servers):
    far = servers(default="hold")  # never answers: only a closed connection ends its handler
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model", max_retries=0)
    with live_server(create_app(backend, ServerConfig(served_model_name="proxy"))) as url:
        try:
            httpx.post(f"{url}/generative_scoring", json=BODY, timeout=httpx.Timeout(5.0, read=0.5))
        except httpx.ReadTimeout:
            pass  # the client gives up and closes its connection
        # the far request is closed within moments, not at the remote client's 120 s deadline
        assert wait_for(lambda: far.abandoned == 1, 5.0), (far.hits, far.in_flight)
        assert wait_for(lambda: far.in_flight == 0, 2.0)
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert far.hits == 1
    assert "rerankit_cancelled_total 1" in metrics and "rerankit_batches_stopped_total 1" in metrics


def test_a_proxied_request_whose_client_stays_is_answered(servers):
    far = servers()
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model")
    with live_server(create_app(backend, ServerConfig(served_model_name="proxy"))) as url:
        reply = httpx.post(f"{url}/generative_scoring", json=BODY, timeout=10)
    assert reply.status_code == 200, reply.text
    assert [row["score"] for row in sorted(reply.json()["data"], key=lambda row: row["index"])] == [0.0, 0.001]


def test_a_far_retry_after_outlives_the_proxys_own_retries(servers):
    far = servers(script=["429:7", "429:2"])
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model", max_retries=1,
                            backoff_max=0.05)  # the proxy retries once, sooner than asked
    with live_server(create_app(backend, ServerConfig(retry_after_s=1))) as url:
        reply = httpx.post(f"{url}/generative_scoring", json=BODY, timeout=10)
    assert reply.status_code == 429 and reply.json()["error"]["message"] == "fault 429"
    assert reply.headers["retry-after"] == "2", "the far server's last word, not the proxy's 1"
    assert far.hits == 2


def test_a_far_retry_after_past_the_deadline_is_passed_on_at_once(servers):
    far = servers(script=["503:30"])
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model", deadline=5,
                            backoff_max=60)
    with live_server(create_app(backend, ServerConfig())) as url:
        started = time.monotonic()
        reply = httpx.post(f"{url}/generative_scoring", json=BODY, timeout=10)
        took = time.monotonic() - started
    assert reply.status_code == 503 and reply.headers["retry-after"] == "30", reply.text
    assert far.hits == 1 and took < 2.0


def test_proxy_health_follows_the_far_server_and_probes_it_at_most_once_an_interval(servers):
    far = servers()
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model")
    now = [0.0]  # the verdict's clock, moved by hand: a loaded machine's pauses do not end an interval
    backend.far_health._clock = lambda: now[0]
    interval = backend.far_health.interval
    with live_server(create_app(backend, ServerConfig())) as url:
        assert all(health(url) == (200, {"status": "ok"}) for _ in range(5))
        assert far.health_hits == 1, "one probe answers every check within the interval"
        far.health = "503"  # e.g. its engine died
        assert health(url)[0] == 200, "the verdict is kept for the interval"
        now[0] += interval
        status, body = health(url)
        assert status == 503 and body["error"]["message"] == f"far server {far.url} is unreachable " \
                                                             "(its /health answered 503)"
        assert body["error"]["type"] == "upstream_error" and body["error"]["code"] == 503
        far.health = "200"
        now[0] += interval
        assert health(url)[0] == 200 and far.health_hits == 3


def test_a_far_request_that_just_succeeded_counts_as_healthy_without_a_probe(servers):
    far = servers()
    far.health = "503"  # a probe would say unhealthy: none is made
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model")
    with live_server(create_app(backend, ServerConfig())) as url:
        assert httpx.post(f"{url}/generative_scoring", json=BODY, timeout=10).status_code == 200
        assert health(url) == (200, {"status": "ok"})
    assert far.health_hits == 0


def test_proxy_health_names_the_far_server_without_its_credentials(dead_url):
    secret_url = dead_url.replace("http://", "http://user:s3cret@")
    backend = RemoteBackend(secret_url, dialect="cohere")
    with live_server(create_app(backend, ServerConfig(api_key="proxy-key"))) as url:  # /health needs no key
        reply = httpx.get(url + "/health", timeout=5)
    assert reply.status_code == 503 and reply.headers["content-type"] == "application/json"
    assert reply.json()["error"]["message"] == f"far server {dead_url} is unreachable (ConnectError)"
    assert "s3cret" not in reply.text and "user" not in reply.text


def test_a_proxys_502_never_shows_the_far_servers_credentials(servers, dead_url):
    """A far 401, a far 500, a dropped connection and a refused one each answer 502 naming the far URL, never its
    user and password."""
    far = servers(script=["401", "500", "reset"])
    for far_url, tries in ((far.url, 3), (dead_url, 1)):
        backend = RemoteBackend(far_url.replace("http://", "http://user:s3cret@"), dialect="vllm-generative",
                                served_model="fault-model", max_retries=0)
        with live_server(create_app(backend, ServerConfig())) as url:
            replies = [httpx.post(f"{url}/generative_scoring", json=BODY, timeout=10) for _ in range(tries)]
        for reply in replies:
            assert reply.status_code == 502 and far_url.removeprefix("http://") in reply.text, reply.text
            assert "s3cret" not in reply.text and "user" not in reply.text, reply.text


def test_a_far_server_that_does_not_answer_its_probe_is_unhealthy_in_bounded_time(servers):
    far = servers()
    far.health = "hang"
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model")
    backend.far_health.timeout = 0.3
    with live_server(create_app(backend, ServerConfig())) as url:
        started = time.monotonic()
        status, body = health(url)
        took = time.monotonic() - started
    assert status == 503 and body["error"]["message"].endswith("(no answer within 0.3 s)")
    assert took < 1.5


def test_health_checks_asked_at_once_share_one_probe(servers):
    far = servers()
    far.health = "hang"
    backend = RemoteBackend(far.url, dialect="vllm-generative", served_model="fault-model")
    backend.far_health.timeout = 0.5
    with live_server(create_app(backend)) as url, ThreadPoolExecutor(8) as pool:
        statuses = [status for status, _ in pool.map(lambda _: health(url), range(8))]
    assert statuses == [503] * 8 and far.health_hits == 1


def test_a_proxy_with_one_far_server_up_is_healthy_and_with_none_names_each(servers, dead_url):
    far = servers()
    other_dead = dead_url.replace("127.0.0.1", "localhost")
    one_up = RemoteBackend([dead_url, far.url], dialect="cohere")
    none_up = RemoteBackend([dead_url, other_dead], dialect="cohere")
    with live_server(create_app(one_up)) as up, live_server(create_app(none_up)) as down:
        assert health(up) == (200, {"status": "ok"})
        status, body = health(down)
    assert status == 503 and body["error"]["message"].startswith(f"no far server is reachable: {dead_url} (")
    assert other_dead in body["error"]["message"]


def test_a_proxy_of_a_proxy_whose_far_server_is_down_is_unhealthy(dead_url):
    with live_server(create_app(RemoteBackend(dead_url, dialect="cohere"))) as inner, \
            live_server(create_app(RemoteBackend(inner, dialect="cohere"))) as outer:
        status, body = health(outer)
    assert status == 503 and body["error"]["message"] == f"far server {inner} is unreachable " \
                                                         "(its /health answered 503)"


def health(url: str) -> tuple[int, dict]:
    reply = httpx.get(url + "/health", timeout=5)
    return reply.status_code, reply.json()
