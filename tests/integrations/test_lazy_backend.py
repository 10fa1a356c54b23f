"""The adapters' shared plumbing: the backend is built once, on first use, off the event loop for async callers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fake_backends import WordOverlapBackend

import rerankit.integrations as integrations
from rerankit.errors import RerankitError
from rerankit.integrations import LazyBackend, embed_texts
from rerankit.integrations.langchain import RerankitEmbeddings


@pytest.fixture
def built(monkeypatch) -> list[tuple[object, dict, str]]:
    """Replaces make_backend with a slow fake factory; lists (model, options, building thread) per build."""
    builds: list[tuple[object, dict, str]] = []

    def slow_factory(model, **options):
        builds.append((model, options, threading.current_thread().name))
        time.sleep(0.05)  # long enough for racing callers to pile up behind the lock
        return WordOverlapBackend()

    monkeypatch.setattr(integrations, "make_backend", slow_factory)
    return builds


def test_nothing_is_built_until_first_use_then_once_for_racing_threads(built):
    lazy = LazyBackend("some/model", {"device": "cpu"})
    assert built == []

    with ThreadPoolExecutor(max_workers=4) as pool:
        backends = list(pool.map(lambda _: lazy.get(), range(4)))

    assert len(built) == 1 and built[0][:2] == ("some/model", {"device": "cpu"})
    assert all(backend is backends[0] for backend in backends)


async def test_a_first_async_use_builds_off_the_event_loop_thread(built):
    backend = await LazyBackend(None).aget()

    assert isinstance(backend, WordOverlapBackend)
    assert built[0][2] != threading.current_thread().name


def test_close_releases_a_built_backend_but_not_a_passed_in_one(built):
    lazy = LazyBackend("some/model")
    own = lazy.get()
    lazy.close()
    passed_in = WordOverlapBackend()
    LazyBackend(backend=passed_in).close()

    assert own.closed and not passed_in.closed


def test_embeddings_from_a_backend_without_pooled_states_are_a_clear_error(overlap_backend):
    with pytest.raises(RerankitError, match="returned no pooled embeddings"):
        RerankitEmbeddings(backend=overlap_backend).embed_query("a query")
    assert embed_texts(LazyBackend(backend=overlap_backend), []) == []
