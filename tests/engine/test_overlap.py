"""Planning while the model runs: the prefetch thread, the streaming planner fed in chunks, and the backend's
overlap mode (worker-thread planning plus a ramp-up chunk), which must score exactly as the plain path does."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from rerankit.engine import EmbeddedBackend
from rerankit.engine import backend as backend_module
from rerankit.engine.plan import Planner, RequestParts
from rerankit.engine.prefetch import prefetch
from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreRequest
from test_fast_path import DOCS, QUERY, make_decoder
from test_mis import assert_same_results, random_parts, random_raw_request, reads_with_their_own_pairs


def test_prefetch_keeps_order_and_runs_ahead_on_another_thread():
    threads = []

    def produce():
        for value in range(50):
            threads.append(threading.current_thread())
            yield value

    assert list(prefetch(produce(), depth=3)) == list(range(50))
    assert all(thread is not threading.current_thread() for thread in threads)


def test_prefetch_raises_the_error_where_it_happened():
    def produce():
        yield 1
        yield 2
        raise InvalidRequest("items[2]", "too long")

    seen = []
    with pytest.raises(InvalidRequest, match=r"items\[2\]"):
        for value in prefetch(produce(), depth=1):
            seen.append(value)
    assert seen == [1, 2]


def test_prefetch_stops_and_joins_its_worker_when_the_consumer_stops():
    closed = threading.Event()

    def produce():
        try:
            for value in range(10**6):
                yield value
        finally:
            closed.set()

    before = threading.active_count()
    stream = prefetch(produce(), depth=2)
    assert next(stream) == 0
    stream.close()
    assert closed.wait(5)
    time.sleep(0.05)
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="depth"):
        next(prefetch(iter([]), depth=0))


def chunked(parts: RequestParts, rng: random.Random) -> list[RequestParts]:
    """The request's items cut into random contiguous chunks, as the backend encodes a ramped request."""
    cuts = sorted(rng.sample(range(1, len(parts.items)), rng.randint(0, min(3, len(parts.items) - 1))))
    chunks = []
    for start, stop in zip([0, *cuts], [*cuts, len(parts.items)]):
        chunks.append(RequestParts(parts.prefix.copy(), parts.items[start:stop], parts.suffix, parts.read_first,
                                   parts.share_prefix, parts.head, parts.own_batches, parts.prefix_types,
                                   parts.item_type, parts.suffix_types, item_offset=start))
    return chunks


@pytest.mark.parametrize("causal", [True, False])
def test_chunks_and_early_closes_plan_every_item_once_with_its_own_pair(causal):
    rng = random.Random(11 + causal)
    for budget in (5, 37, 200, 10**6):
        requests = [random_parts(rng, causal, typed=False, head_count=2) for _ in range(rng.randint(1, 6))]
        planner = Planner(budget, padded=False, causal=causal)
        micro_batches = []
        for index, parts in enumerate(requests):
            for chunk in chunked(parts, rng):
                micro_batches += planner.add(index, chunk)
                if rng.random() < 0.3:
                    micro_batches += planner.close()
        micro_batches += planner.finish()
        seen = []
        for micro in micro_batches:
            batch = micro.batch
            lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
            assert sum(lengths) <= budget or len(lengths) == 1
            seen += reads_with_their_own_pairs(micro, requests)
        assert sorted(seen) == [(index, item) for index, parts in enumerate(requests)
                                for item in range(len(parts.items))]


def test_chunks_of_one_request_in_one_micro_batch_share_one_prefix():
    items = [np.arange(10, 10 + length) for length in (3, 5, 2, 7, 4)]
    parts = RequestParts(np.arange(1, 9), items, np.array([99]), share_prefix=True)
    planner = Planner(10**6, padded=False, causal=True)
    first = RequestParts(parts.prefix.copy(), items[:2], parts.suffix, share_prefix=True)
    rest = RequestParts(parts.prefix.copy(), items[2:], parts.suffix, share_prefix=True, item_offset=2)
    micro_batches = [*planner.add(0, first), *planner.add(0, rest), *planner.finish()]
    assert len(micro_batches) == 1
    batch = micro_batches[0].batch
    assert batch.cu_seqlens.tolist() == [0, 8 + sum(len(item) + 1 for item in items)]
    assert micro_batches[0].read_items.tolist() == [0, 1, 2, 3, 4]
    assert micro_batches[0].request_tokens == {0: batch.num_tokens}


def test_an_empty_span_is_read_at_the_prefixs_last_token_in_a_continued_sequence_too():
    items = [np.arange(10, 10 + length) for length in (3, 0, 2, 0)]
    empty = np.array([], dtype=np.int64)  # no suffix: raw scoring
    planner = Planner(10**6, padded=False, causal=True)
    first = RequestParts(np.arange(1, 9), items[:2], empty, share_prefix=True)
    rest = RequestParts(np.arange(1, 9), items[2:], empty, share_prefix=True, item_offset=2)
    (micro,) = [*planner.add(0, first), *planner.add(0, rest), *planner.finish()]
    assert micro.batch.cu_seqlens.tolist() == [0, 8 + 5]
    assert micro.read_items.tolist() == [0, 1, 2, 3]
    assert micro.batch.read_positions.tolist() == [10, 7, 12, 7]  # prefix 0-7, item 0 at 8-10, item 2 at 11-12


def test_untyped_pairs_beside_typed_ones_take_type_zero():
    """A micro-batch whose pairs are typed (BERT's segments) and untyped keeps one type a token, zeros for the
    untyped ones (what a model takes for no types); its types were shorter than its tokens."""
    typed = RequestParts(np.array([1, 2, 3]), [np.array([4, 5])], np.array([6]), read_first=True,
                         prefix_types=np.array([0, 0, 0]), item_type=1, suffix_types=np.array([1]))
    untyped = RequestParts(np.array([7, 8]), [np.array([9]), np.array([10, 11])], np.array([], dtype=np.int64))
    for order in ([untyped, typed], [typed, untyped]):
        planner = Planner(10**6, padded=False, causal=False)
        (micro,) = [*planner.add(0, order[0]), *planner.add(1, order[1]), *planner.finish()]
        ids, types = micro.batch.input_ids.tolist(), micro.batch.token_type_ids.tolist()
        assert len(types) == len(ids) == 6 + 7
        assert [kind for token, kind in zip(ids, types) if token in (4, 5, 6)] == [1, 1, 1]
        assert sum(types) == 3


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    return make_decoder(tmp_path_factory.mktemp("overlap") / "qwen3-lm", "lm")


@pytest.mark.parametrize("budget", [64, 32768])
def test_overlap_scores_equal_the_plain_path(lm_path, budget):
    plain = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", max_batch_tokens=budget, overlap=False)
    overlapped = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", max_batch_tokens=budget, overlap=True)
    rng = random.Random(budget)
    vocab = plain._model().vocab_size
    many = [DOCS[index % len(DOCS)] + f" {index}" for index in range(40)]  # ramped: 16 items, then 24
    requests = [ScoreRequest(query=QUERY, items=many, template="qwen3-reranker"),
                random_raw_request(rng, vocab, items=35),
                ScoreRequest(query=QUERY, items=many[:5], template="qwen3-reranker", multi_item=False)]
    for expected, response in zip(plain.score_batch(requests), overlapped.score_batch(requests)):
        assert [result.index for result in response.results] == list(range(len(expected.results)))
        torch.testing.assert_close(torch.tensor(response.scores), torch.tensor(expected.scores), atol=1e-5, rtol=0)
        assert response.usage.prompt_tokens == expected.usage.prompt_tokens
        assert response.usage.computed_tokens >= expected.usage.computed_tokens
    assert_same_results(overlapped.score(requests[1]), plain.score(requests[1]))


def test_overlap_ramp_counts_the_repeated_prefix_once_more(lm_path):
    overlapped = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", overlap=True)
    plain = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", overlap=False)
    request = ScoreRequest(query=[5, 6, 7], items=[[20 + index, 21] for index in range(40)], label_token_ids=[30, 31])
    ramped, single = overlapped.score(request), plain.score(request)
    assert single.usage.computed_tokens == 3 + 40 * 2
    assert ramped.usage.computed_tokens == single.usage.computed_tokens + 3  # the first 16 items ran apart


def test_ramp_chunks_follow_the_schedule_while_as_many_items_follow(lm_path, monkeypatch):
    backend = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", overlap=True)
    monkeypatch.setattr(backend_module, "RAMP_CHUNKS", (8, 24))
    request = ScoreRequest(query=[5], items=[[20, 21]] * 100, label_token_ids=[30, 31])
    assert backend._chunks(request, True) == [slice(0, 8), slice(8, 32), slice(32, 100)]
    fewer = request.model_copy(update={"items": [[20, 21]] * 40})  # 8 more after 32 would leave fewer than 32
    assert backend._chunks(fewer, True) == [slice(0, 8), slice(8, 40)]
    assert backend._chunks(request.model_copy(update={"items": [[20, 21]] * 15}), True) == [slice(0, 15)]
    assert backend._chunks(request, False) == [slice(0, 100)]


def test_ramp_chunks_each_run_apart_and_score_as_one_chunk(lm_path, monkeypatch):
    monkeypatch.setattr(backend_module, "RAMP_CHUNKS", (8, 24))
    overlapped = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", overlap=True)
    plain = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", overlap=False)
    request = ScoreRequest(query=[5, 6], items=[[20 + index, 21, 22] for index in range(100)], label_token_ids=[30, 31])
    ramped, single = overlapped.score(request), plain.score(request)
    assert ramped.usage.computed_tokens == single.usage.computed_tokens + 2 * 2  # two ramp chunks repeat the prefix
    torch.testing.assert_close(torch.tensor(ramped.scores), torch.tensor(single.scores), atol=1e-5, rtol=0)


def test_a_prefix_long_next_to_the_first_items_is_encoded_in_one_chunk(lm_path):
    backend = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", overlap=True)
    items = [f"doc {index}" for index in range(40)]
    long_query = ScoreRequest(query="a long question " * 40, items=items, template="qwen3-reranker")
    assert backend._chunks(long_query, True) == [slice(0, 40)]
    long_instruction = ScoreRequest(query="q", items=items, template="qwen3-reranker", instruction="rank well " * 60)
    assert backend._chunks(long_instruction, True) == [slice(0, 40)]
    assert backend._chunks(long_query.model_copy(update={"query": "q"}), True) == [slice(0, 16), slice(16, 40)]


def test_overlap_errors_in_a_later_chunk_name_the_item_and_drop_the_request(lm_path):
    backend = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", overlap=True)
    vocab = backend._model().vocab_size
    items = [[11, 12]] * 40
    items[30] = [11, vocab + 5]  # out of the vocabulary, in the second chunk
    bad = ScoreRequest(query=[5, 6, 7], items=items, label_token_ids=[30, 31])
    good = ScoreRequest(query=[5, 6], items=[[13], [14, 15]], label_token_ids=[30, 31], return_label_logprobs=True)
    with pytest.raises(InvalidRequest, match=r"items\[30\]"):
        backend.score_batch([bad, good])
    error, response = backend.score_batch([bad, good], return_exceptions=True)
    assert isinstance(error, InvalidRequest) and "items[30]" in str(error)
    assert_same_results(response, backend.score(good))


@pytest.mark.gpu
def test_gpu_overlap_and_pinned_plans_score_as_the_plain_path(lm_path):
    plain = EmbeddedBackend(str(lm_path), device="cuda", dtype="float32", max_batch_tokens=256)
    overlapped = EmbeddedBackend(str(lm_path), device="cuda", dtype="float32", max_batch_tokens=256, overlap=True)
    many = [DOCS[index % len(DOCS)] + f" {index}" for index in range(40)]
    requests = [ScoreRequest(query=QUERY, items=many, template="qwen3-reranker"),
                random_raw_request(random.Random(3), plain._model().vocab_size, items=35)]
    for expected, response in zip(plain.score_batch(requests), overlapped.score_batch(requests)):
        torch.testing.assert_close(torch.tensor(response.scores), torch.tensor(expected.scores), atol=1e-4, rtol=0)


def _calls_from_two_threads(backend: EmbeddedBackend, calls: list[list[ScoreRequest]]) -> list:
    """Each call in ``calls`` run from one of two threads, both started together; their responses in call order."""
    results: list = [None] * len(calls)
    start = threading.Barrier(2)

    def worker(offset: int) -> None:
        start.wait()
        for index in range(offset, len(calls), 2):
            results[index] = backend.score_batch(calls[index])

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def _pipelined_calls_score_as_one_at_a_time(backend: EmbeddedBackend, atol: float) -> None:
    rng = random.Random(7)
    vocab = backend._model().vocab_size
    many = [DOCS[index % len(DOCS)] + f" {index}" for index in range(24)]
    calls = [[ScoreRequest(query=QUERY + f" {round_}", items=many[round_:], template="qwen3-reranker",
                           return_label_logprobs=round_ % 2 == 0),
              random_raw_request(rng, vocab, items=5 + round_)] for round_ in range(6)]
    expected = [backend.score_batch(call) for call in calls]
    for got, want in zip(_calls_from_two_threads(backend, calls), expected):
        for response, reference in zip(got, want):
            assert [result.index for result in response.results] == list(range(len(reference.results)))
            torch.testing.assert_close(torch.tensor(response.scores), torch.tensor(reference.scores), atol=atol,
                                       rtol=0)
            for result, reference_result in zip(response.results, reference.results):
                assert (result.label_logprobs is None) == (reference_result.label_logprobs is None)
                if result.label_logprobs is not None:
                    torch.testing.assert_close(torch.tensor(result.label_logprobs),
                                               torch.tensor(reference_result.label_logprobs), atol=atol, rtol=0)


def test_calls_from_two_threads_score_as_one_at_a_time(lm_path):
    backend = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", max_batch_tokens=256)
    assert backend.pipelined_calls == 1  # the CPU's work is synchronous: nothing to overlap
    _pipelined_calls_score_as_one_at_a_time(backend, atol=1e-6)


@pytest.mark.gpu
def test_gpu_pipelined_calls_score_as_one_at_a_time(lm_path):
    """Two threads: one call launches (CUDA graphs included) while the other's scores are still being copied back."""
    backend = EmbeddedBackend(str(lm_path), device="cuda", dtype="float32", max_batch_tokens=256)
    assert backend.pipelined_calls == 2
    _pipelined_calls_score_as_one_at_a_time(backend, atol=1e-5)


def test_a_ramped_request_refuses_the_item_the_whole_request_would(tiny_bert_embedder):
    """Items checked chunk by chunk used to report the first chunk's too-long item where the whole request reports
    a later item's id outside the vocabulary (ids are checked before lengths)."""
    items = [[1000]] * 40
    items[1], items[30] = [1000] * 600, [30522]
    request = ScoreRequest(query="q", items=items, truncation="none")
    fields = []
    for options in ({"runner": "reference"}, {"runner": "packed"}, {"runner": "packed", "overlap": True}):
        with pytest.raises(InvalidRequest) as error:
            EmbeddedBackend(str(tiny_bert_embedder), device="cpu", **options).score(request)
        fields.append(error.value.field)
    assert fields == ["items[30]"] * 3
