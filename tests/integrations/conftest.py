"""Fixtures for the adapter tests: a word-overlap fake backend (mapping tests) and the real packaged MiniLM."""

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
