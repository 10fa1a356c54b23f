"""``ScoreRequest.priority`` on the wire: vLLM's bodies and Cohere's carry it (and rerankit serve reads it back into
the request), the other dialects refuse a priority they cannot carry, and a proxy honours it in its own queue
without sending it on."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from live_server import live_server
from server_fakes import RecordingBackend

from rerankit.errors import InvalidRequest
from rerankit.remote import RemoteBackend
from rerankit.remote.dialects import DIALECTS, get_dialect
from rerankit.schema import ScoreRequest
from rerankit.server.app import create_app
from rerankit.server.limits import ServerConfig

CARRIED = ("vllm-generative", "vllm-score", "vllm-rerank", "cohere")


def request(priority: int, dialect: str) -> ScoreRequest:
    if dialect == "vllm-generative":
        return ScoreRequest(query="q", items=["a", "b"], label_token_ids=[1, 2], priority=priority)
    return ScoreRequest(query="q", items=["a", "b"], priority=priority)


@pytest.mark.parametrize("dialect", CARRIED)
def test_vllm_and_cohere_bodies_carry_a_priority_and_the_server_reads_it_back(dialect):
    wire = get_dialect(dialect)
    _, body = wire.encode_request(request(7, dialect), "m")
    assert body["priority"] == 7
    assert wire.parse_request(body).priority == 7
    _, plain = wire.encode_request(request(0, dialect), "m")
    assert "priority" not in plain  # the default is not sent: a vLLM without priority scheduling takes the body


@pytest.mark.parametrize("dialect", sorted(set(DIALECTS) - set(CARRIED)))
def test_the_other_dialects_refuse_a_priority_naming_the_field(dialect):
    with pytest.raises(InvalidRequest) as refused:
        get_dialect(dialect).encode_request(request(3, dialect), "m")
    assert refused.value.field == "priority" and "no request priority" in refused.value.reason


def test_an_out_of_range_priority_is_refused_by_name():
    with pytest.raises(InvalidRequest) as refused:
        get_dialect("vllm-rerank").parse_request({"query": "q", "documents": ["a"], "priority": 2**63})
    assert refused.value.field == "priority"


def test_remote_backend_priority_orders_a_rerankit_servers_queue_and_a_proxy_does_not_send_it_on():
    far_backend = RecordingBackend(hold_first_call=True)
    with live_server(create_app(far_backend, ServerConfig(max_batch_items=1, batch_window_ms=0))) as far_url, \
            RemoteBackend(far_url, dialect="vllm-rerank") as far:
        threads = [threading.Thread(target=far.score, args=(ScoreRequest(query="first", items=["x"]),))]
        threads[0].start()
        assert far_backend.entered.wait(10)
        for query, priority in (("low", 9), ("high", 1)):
            threads.append(threading.Thread(target=far.score,
                                            args=(ScoreRequest(query=query, items=["x"], priority=priority),)))
            threads[-1].start()
            time.sleep(0.1)
        far_backend.gate.set()
        for thread in threads:
            thread.join(20)
        assert [call[0] for call in far_backend.calls] == ["first", "high", "low"]
        with RemoteBackend(far_url, dialect="vllm-rerank") as to_far, \
                live_server(create_app(to_far, ServerConfig())) as near_url:
            reply = httpx.post(near_url + "/rerank", json={"query": "proxied", "documents": ["x"], "priority": 4},
                               timeout=10)
        assert reply.status_code == 200, reply.text
        assert far_backend.requests[-1].query == "proxied" and far_backend.requests[-1].priority == 0
