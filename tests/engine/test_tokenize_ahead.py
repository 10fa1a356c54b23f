"""A ramped request's later chunks are tokenized on a worker thread while the first chunk is planned and run
(``EmbeddedBackend._tokenize_ahead``): the same ids, scores and errors as tokenizing them when planned, and no
tokenizing left running once a call has ended."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rerankit.engine import EmbeddedBackend
from rerankit.engine import backend as backend_module
from rerankit.engine.backend import _Call
from rerankit.errors import Cancelled, InvalidRequest
from rerankit.schema import ScoreRequest
from test_fast_path import DOCS, QUERY, make_decoder


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    return make_decoder(tmp_path_factory.mktemp("ahead") / "qwen3-lm", "lm")


def ramped(lm_path, ahead: bool) -> EmbeddedBackend:
    backend = EmbeddedBackend(str(lm_path), device="cpu", runner="packed")
    backend._ramp = True  # as with CUDA graphs: the first 16 items, then the rest
    backend._tokenize_later_chunks = ahead
    return backend


def texts(count: int) -> list[str]:
    return [f"{DOCS[index % len(DOCS)]} {index} " + "word " * (index % 7) for index in range(count)]


@pytest.mark.parametrize("request_", [
    ScoreRequest(query=QUERY, items=texts(40), template="qwen3-reranker", instruction="Find the capital"),
    ScoreRequest(query=QUERY, items=texts(40), template="qwen3-reranker", max_tokens_per_item=3),
    ScoreRequest(query=[5, 6, 7], items=[[20 + index, 21] for index in range(40)], label_token_ids=[30, 31]),
], ids=["template", "cut-items", "token-ids"])
def test_later_chunks_tokenized_ahead_encode_and_score_as_when_planned(lm_path, monkeypatch, request_):
    threads = []
    real = backend_module.later_item_ids

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(backend_module, "later_item_ids", recorded)
    ahead, planned = ramped(lm_path, True), ramped(lm_path, False)
    call = _Call([request_])
    batches = list(ahead._plan(call, ahead._model(), False))
    assert len(threads) == 1 and threads[0].startswith("rerankit-tokenize")
    reference = _Call([request_])
    assert [b.batch.num_tokens for b in planned._plan(reference, planned._model(), False)] == \
        [b.batch.num_tokens for b in batches]
    assert len(threads) == 1  # tokenized when planned: on this thread, not through the worker
    assert call.entries[0].encoded.item_ids == reference.entries[0].encoded.item_ids
    first, second = ahead.score(request_), planned.score(request_)
    torch.testing.assert_close(torch.tensor(first.scores), torch.tensor(second.scores), atol=0, rtol=0)
    assert [r.index for r in first.results] == [r.index for r in second.results]


def test_an_error_in_a_chunk_tokenized_ahead_names_its_item_and_spares_the_other_requests(lm_path):
    backend = ramped(lm_path, True)
    vocab = backend._model().vocab_size
    items = [[11, 12]] * 40
    items[30] = [11, vocab + 5]  # out of the vocabulary, in the later chunk
    bad = ScoreRequest(query=[5, 6, 7], items=items, label_token_ids=[30, 31])
    good = ScoreRequest(query=[5, 6], items=[[13], [14, 15]], label_token_ids=[30, 31])
    with pytest.raises(InvalidRequest, match=r"items\[30\]"):
        backend.score_batch([bad, good])
    error, response = backend.score_batch([bad, good], return_exceptions=True)
    assert isinstance(error, InvalidRequest) and "items[30]" in str(error)
    assert response.scores == backend.score(good).scores


def test_a_stopped_call_returns_only_after_its_tokenizing_ahead_has_ended(lm_path, monkeypatch):
    finished = threading.Event()
    real = backend_module.later_item_ids

    def slow(*args):
        time.sleep(0.3)  # still tokenizing when the call is stopped
        ids = real(*args)
        finished.set()
        return ids

    monkeypatch.setattr(backend_module, "later_item_ids", slow)
    backend = ramped(lm_path, True)
    request = ScoreRequest(query=QUERY, items=texts(40), template="qwen3-reranker")
    with pytest.raises(Cancelled):  # stopped at the first micro-batch, planned once the rest was submitted
        backend.score_batch([request], should_stop=lambda: True)
    assert finished.is_set()
    backend.close()
    assert backend._tokenizer_thread is None
