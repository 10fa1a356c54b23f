"""Fixtures for the adapter tests: a word-overlap fake backend (mapping tests), the real packaged MiniLM, and the
MiniLM behind rerankit's HTTP server (URL models)."""

from __future__ import annotations

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
    from live_server import live_server

    from rerankit.server.app import create_app

    with live_server(create_app(minilm_backend)) as url:
        yield url
