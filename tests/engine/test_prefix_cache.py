"""Long prompt heads kept across calls (``engine.prefix_cache``): the scores equal computing every head, the planner
lays the rest of each sequence out after the head, and the cache keeps what fits."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rerankit.engine import EmbeddedBackend
from rerankit.engine.plan import Planner, RequestParts
from rerankit.engine.prefix_cache import (KEPT_HEAD_MULTIPLE, PREFIX_CACHE_MIN_TOKENS, CachedKV, PrefixCache,
                                          kept_length)
from rerankit.schema import ScoreRequest

WORDS = ["paris", "france", "capital", "river", "museum", "bread", "wine", "tower", "city", "art", "history"]


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def requests(seed: int = 0) -> list[ScoreRequest]:
    """Two requests under one long instruction, one under another, and one without: heads kept and not."""
    rng = random.Random(seed)
    long_a, long_b = words(rng, 2 * PREFIX_CACHE_MIN_TOKENS), words(rng, PREFIX_CACHE_MIN_TOKENS + 40)
    made = []
    for instruction in (long_a, long_b, None, long_a):
        items = [words(rng, rng.randrange(1, 30)) for _ in range(rng.randrange(2, 9))]
        made.append(ScoreRequest(query=words(rng, 6), items=items, instruction=instruction,
                                 template="qwen3-reranker"))
    return made


@pytest.fixture(scope="module")
def backends(tiny_qwen3_lm):
    kept = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu")
    computed = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", prefix_cache_bytes=0)
    return kept, computed


def scores(responses) -> list[list[float]]:
    return [[result.score for result in response.results] for response in responses]


@pytest.mark.parametrize("projections", ["", "qkv,o,gate_up,down"], ids=["default", "all"])
def test_fp8_kept_heads_score_as_computed_heads(tiny_qwen3_lm, monkeypatch, projections):
    """FP8 (reference numerics on the CPU): a kept head's keys and values come from the same forward, pending
    residual adds included, as a head computed with its items."""
    from rerankit.engine.fp8 import PROJECTIONS_ENV, REFERENCE_ENV

    monkeypatch.setenv(REFERENCE_ENV, "1")
    monkeypatch.setenv(PROJECTIONS_ENV, projections)
    kept = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="fp8")
    computed = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="fp8", prefix_cache_bytes=0)
    batch = requests(1)
    expected = computed.score_batch(batch)
    for _ in range(2):
        for got_scores, want in zip(scores(kept.score_batch(batch)), scores(expected)):
            # bf16 rounding, which e4m3 codes flipping a step amplify: up to 0.0017 over eight request sets, where
            # FP8's own deviation from float32 is 0.003-0.004
            np.testing.assert_allclose(got_scores, want, atol=2e-3, rtol=0)
    assert kept._runner.prefix_cache.hits >= 2


def test_kept_heads_score_as_computed_heads(backends):
    kept, computed = backends
    assert kept._runner.prefix_cache is not None and computed._runner.prefix_cache is None
    batch = requests()
    expected = computed.score_batch(batch)
    for _ in range(2):  # the first call fills the cache, the second reads it
        got = kept.score_batch(batch)
        for got_scores, want in zip(scores(got), scores(expected)):
            np.testing.assert_allclose(got_scores, want, atol=1e-5, rtol=1e-5)
    cache = kept._runner.prefix_cache
    assert (len(cache), cache.fills) == (2, 2) and cache.hits >= 4
    assert all(entry.tokens % KEPT_HEAD_MULTIPLE == 0 for entry in cache._entries.values())  # whole key tiles
    # Every item comes back once, with its index; the kept head's tokens are not computed again.
    for response, request in zip(got, batch):
        assert [result.index for result in response.results] == list(range(len(request.items)))
    assert got[2].usage.computed_tokens == expected[2].usage.computed_tokens
    assert got[0].usage.computed_tokens < expected[0].usage.computed_tokens - PREFIX_CACHE_MIN_TOKENS
    assert got[0].usage.prompt_tokens == expected[0].usage.prompt_tokens


def test_each_request_alone_scores_as_in_a_shared_call(backends):
    kept, _ = backends
    batch = requests(seed=1)
    together = scores(kept.score_batch(batch))
    for request, want in zip(batch, together):
        np.testing.assert_allclose(scores([kept.score(request)])[0], want, atol=1e-5, rtol=1e-5)


def test_short_heads_and_single_items_are_computed(backends):
    kept, _ = backends
    cache = kept._runner.prefix_cache
    cache.clear()
    rng = random.Random(2)
    short = ScoreRequest(query="capital", items=["paris", "lyon"], instruction=words(rng, 20),
                         template="qwen3-reranker")
    single = ScoreRequest(query="capital", items=["paris"], instruction=words(rng, 400), template="qwen3-reranker")
    kept.score_batch([short, single])
    assert len(cache) == 0  # a short head is not worth a separate forward; one item shares no prefix


def test_a_split_request_keeps_one_head_for_every_micro_batch(tiny_qwen3_lm):
    small = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", max_batch_tokens=120)
    computed = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", max_batch_tokens=120, prefix_cache_bytes=0)
    rng = random.Random(3)
    request = ScoreRequest(query="capital of france", items=[words(rng, 20) for _ in range(12)],
                           instruction=words(rng, 300), template="qwen3-reranker")
    got = small.score(request)
    np.testing.assert_allclose(scores([got])[0], scores([computed.score(request)])[0], atol=1e-5, rtol=1e-5)
    assert small._runner.prefix_cache.fills == 1 and small._runner.prefix_cache.hits >= 3


def parts_with_head(head: list[int], prefix: list[int], items: list[list[int]], suffix: list[int]) -> RequestParts:
    return RequestParts(prefix=np.array(prefix), items=[np.array(item) for item in items], suffix=np.array(suffix),
                        share_prefix=True, cached_head=np.array(head) if head else None)


def test_planner_lays_sequences_out_after_their_head():
    head, other = list(range(100, 110)), list(range(200, 206))
    planner = Planner(10_000, padded=False, causal=True)
    batches = [*planner.add(0, parts_with_head(head, [1, 2], [[3, 4, 5], [6]], [9])),
               *planner.add(1, parts_with_head([], [7], [[8, 8]], [9])),
               *planner.add(2, parts_with_head(other, [1], [[3]], [9])),
               *planner.finish()]
    assert len(batches) == 2  # another head starts another micro-batch
    first = batches[0].batch
    np.testing.assert_array_equal(first.cached_head, head)
    assert first.cached_lens.tolist() == [10, 0]
    assert first.input_ids.tolist() == [1, 2, 3, 4, 5, 9, 6, 9, 7, 8, 8, 9]
    # Positions start after the head; each item restarts after head + prefix.
    assert first.position_ids.tolist() == [10, 11, 12, 13, 14, 15, 12, 13, 0, 1, 2, 3]
    assert first.prefix_lens.tolist() == [2, 1]
    assert first.read_positions.tolist() == [5, 7, 11]
    # Keys per query count the head's keys: 2 prefix tokens see 10 + 1..2, the spans 12 + their own.
    seen = (10 * 2 + 3) + (12 * 4 + 10) + (12 * 2 + 3) + (0 + 10)
    assert first.keys_per_query == pytest.approx(seen / 12)
    np.testing.assert_array_equal(batches[1].batch.cached_head, other)
    assert batches[0].request_tokens == {0: 8, 1: 4}


def test_a_kept_head_is_cut_to_whole_key_tiles():
    assert kept_length(1_060) == 1_024 and kept_length(1_024) == 1_024 and kept_length(1_087) == 1_024
    assert kept_length(PREFIX_CACHE_MIN_TOKENS + KEPT_HEAD_MULTIPLE - 1) == PREFIX_CACHE_MIN_TOKENS
    assert kept_length(PREFIX_CACHE_MIN_TOKENS - 1) == 0 and kept_length(0) == 0


def kv(tokens: int) -> CachedKV:
    return CachedKV([torch.zeros(tokens, 1, 4)], [torch.zeros(tokens, 1, 4)])  # 32 bytes a token


def test_prefix_cache_drops_least_recently_used_past_its_budget():
    cache = PrefixCache(max_bytes=32 * 25)
    computed = []

    def compute(ids):
        computed.append(len(ids))
        return kv(len(ids))

    for head in ([1] * 10, [2] * 10, [1] * 10, [3] * 10, [1] * 10, [2] * 10, [4] * 30):
        cache.get(np.array(head), compute)
    assert computed == [10, 10, 10, 10, 30]  # [1]*10 stayed (recently used); [2]*10 was dropped for [3]*10
    assert len(cache) == 2 and cache.nbytes == 32 * 20  # a head larger than the budget is computed, not kept
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kept_heads_on_gpu_bf16(tiny_qwen3_lm):
    # Large enough (> 8,192 tokens) to run eagerly, where heads are kept with CUDA graphs on.
    kept = EmbeddedBackend(str(tiny_qwen3_lm), device="cuda", dtype="bfloat16")
    computed = EmbeddedBackend(str(tiny_qwen3_lm), device="cuda", dtype="bfloat16", prefix_cache_bytes=0)
    rng = random.Random(4)
    request = ScoreRequest(query="capital of france", items=[words(rng, 40) for _ in range(70)],
                           instruction=words(rng, 150), template="qwen3-reranker")
    want = scores([computed.score(request)])[0]
    for _ in range(2):
        np.testing.assert_allclose(scores([kept.score(request)])[0], want, atol=2e-2)
    assert kept._runner.prefix_cache.fills == 1 and kept._runner.prefix_cache.hits >= 1



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 (sm_89+)")
@pytest.mark.parametrize("items", [70, 6], ids=["eager", "graphed"])
def test_fp8_kept_heads_on_gpu(tiny_qwen3_lm, monkeypatch, items):
    """The FP8 kernels, o included (its codes written by the attention kernel under a bound that takes in the kept
    head's values), score with a kept head as with the head computed."""
    from rerankit.engine.fp8 import PROJECTIONS_ENV

    monkeypatch.setenv(PROJECTIONS_ENV, "qkv,o,gate_up,down")
    kept = EmbeddedBackend(str(tiny_qwen3_lm), device="cuda", dtype="fp8")
    computed = EmbeddedBackend(str(tiny_qwen3_lm), device="cuda", dtype="fp8", prefix_cache_bytes=0)
    rng = random.Random(4)
    request = ScoreRequest(query="capital of france", items=[words(rng, 40) for _ in range(items)],
                           instruction=words(rng, 150), template="qwen3-reranker")
    want = scores([computed.score(request)])[0]
    for _ in range(2):
        np.testing.assert_allclose(scores([kept.score(request)])[0], want, atol=2e-2)
    assert kept._runner.prefix_cache.hits >= 1


def test_a_decoder_cross_encoder_keeps_heads_too(tiny_qwen3_classifier):
    kept = EmbeddedBackend(str(tiny_qwen3_classifier), device="cpu")
    computed = EmbeddedBackend(str(tiny_qwen3_classifier), device="cpu", prefix_cache_bytes=0)
    rng = random.Random(5)
    request = ScoreRequest(query="capital of france", items=[words(rng, 12) for _ in range(6)],
                           instruction=words(rng, 300), template="qwen3-reranker")
    want = scores([computed.score(request)])[0]
    for _ in range(2):
        np.testing.assert_allclose(scores([kept.score(request)])[0], want, atol=1e-5, rtol=1e-5)
    assert kept._runner.prefix_cache.fills == 1 and kept._runner.prefix_cache.hits == 1
