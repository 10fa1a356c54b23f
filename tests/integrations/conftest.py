"""Fixtures for the adapter tests: a word-overlap fake backend (mapping tests), the real packaged MiniLM, and the
MiniLM behind rerankit's HTTP server (URL models)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fake_backends import WordOverlapBackend


@pytest.fixture
def overlap_backend() -> WordOverlapBackend:
    """A fresh fake backend per test."""
    return WordOverlapBackend()


@pytest.fixture(scope="session")
def minilm_backend():
    """The real embedded engine on the packaged MiniLM default, loaded once for all adapter tests."""
    from rerankit.reranker import make_backend

    backend = make_backend(None, device="cpu")
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def minilm_url(minilm_backend):
    """``minilm_backend`` served by rerankit's HTTP app on a loopback port, for the adapters' URL models."""
    import uvicorn

    from rerankit.server.app import create_app

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(minilm_backend), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    listener.close()
