"""Multi-item scoring (one prefix, many item spans) and cross-request batching: exact, complete, accounted for."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rerankit.engine import EmbeddedBackend
from rerankit.engine.batch import attention_allowed
from rerankit.engine.encode import encode_request
from rerankit.engine.plan import RequestParts, plan_requests
from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreRequest
from rerankit.templates import get_template
from test_fast_path import DOCS, QUERY, make_decoder

EXACT = 1e-5


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    return make_decoder(tmp_path_factory.mktemp("mis") / "qwen3-lm", "lm")


@pytest.fixture(scope="module")
def lm(lm_path):
    return EmbeddedBackend(str(lm_path), device="cpu", runner="packed", multi_item=True)


@pytest.fixture(scope="module")
def reference(lm_path):
    return EmbeddedBackend(str(lm_path), device="cpu", runner="reference")


def random_raw_request(rng: random.Random, vocab: int, items: int | None = None, **options) -> ScoreRequest:
    """Token-id query and items of ragged lengths (some of length 1), two or three labels."""
    count = items or rng.randint(1, 12)
    lengths = [rng.choice([1, 1, 2, rng.randint(3, 30)]) for _ in range(count)]
    return ScoreRequest(query=[rng.randrange(10, vocab) for _ in range(rng.randint(1, 40))],
                        items=[[rng.randrange(10, vocab) for _ in range(length)] for length in lengths],
                        label_token_ids=rng.sample(range(10, vocab), rng.choice([2, 3])),
                        return_label_logprobs=True, **options)


def assert_same_results(response, expected, tolerance=EXACT):
    torch.testing.assert_close(torch.tensor(response.scores), torch.tensor(expected.scores), atol=tolerance, rtol=0)
    torch.testing.assert_close(torch.tensor([r.label_logprobs for r in response.results]),
                               torch.tensor([r.label_logprobs for r in expected.results]), atol=tolerance, rtol=0)


@pytest.mark.parametrize("budget", [16, 64, 10**6])
def test_mis_scores_equal_per_pair_scores_for_random_layouts(lm_path, reference, budget):
    backend = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", multi_item=True,
                              max_batch_tokens=budget)
    vocab = backend._model().vocab_size
    rng = random.Random(budget)
    for _ in range(6):
        request = random_raw_request(rng, vocab)
        shared = backend.score(request)
        assert_same_results(shared, backend.score(request.model_copy(update={"multi_item": False})))
        assert_same_results(shared, reference.score(request))
        if len(request.items) > 1 and budget == 10**6:
            assert shared.usage.computed_tokens == len(request.query) + sum(len(item) for item in request.items)


def test_one_item_and_length_one_items(lm, reference):
    vocab = lm._model().vocab_size
    for items in ([[7]], [[11], [12], [13]], [[20, 21, 22]]):
        request = ScoreRequest(query=[5, 6, 7, 8], items=items, label_token_ids=[30, 31], return_label_logprobs=True)
        assert_same_results(lm.score(request), reference.score(request))
    assert vocab > 31


@pytest.mark.parametrize("instruction", [None, "Given a web search query, retrieve relevant passages"])
def test_template_mis_equals_per_pair_and_reads_the_same_states(lm, reference, instruction):
    request = ScoreRequest(query=QUERY, items=DOCS, template="qwen3-reranker", instruction=instruction,
                           return_pooled_hidden_states=True, return_label_logprobs=True, apply_softmax=False)
    shared, alone = lm.score(request), reference.score(request)
    assert_same_results(shared, alone)
    torch.testing.assert_close(torch.tensor([r.pooled_hidden_state for r in shared.results]),
                               torch.tensor([r.pooled_hidden_state for r in alone.results]), atol=EXACT, rtol=0)
    assert shared.usage.computed_tokens < alone.usage.computed_tokens == alone.usage.prompt_tokens


def test_decoder_cross_encoder_shares_the_prefix_exactly(tmp_path):
    path = make_decoder(tmp_path / "qwen3-cls", "cls", seed=1)
    request = ScoreRequest(query=QUERY, items=DOCS)
    shared = EmbeddedBackend(str(path), device="cpu", runner="packed", multi_item=True).score(request)
    alone = EmbeddedBackend(str(path), device="cpu", runner="reference").score(request)
    torch.testing.assert_close(torch.tensor(shared.scores), torch.tensor(alone.scores), atol=EXACT, rtol=0)
    assert shared.usage.computed_tokens < alone.usage.computed_tokens


def test_split_request_repeats_its_prefix_once_per_micro_batch(lm_path):
    prefix, item_length, count = 9, 5, 7
    request = ScoreRequest(query=list(range(20, 20 + prefix)), items=[[40 + i] * item_length for i in range(count)],
                           label_token_ids=[30, 31])
    budget = prefix + 3 * item_length  # three spans a micro-batch: 3 + 3 + 1
    split = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", multi_item=True,
                            max_batch_tokens=budget).score(request)
    whole = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", multi_item=True).score(request)
    torch.testing.assert_close(torch.tensor(split.scores), torch.tensor(whole.scores), atol=EXACT, rtol=0)
    assert whole.usage.computed_tokens == prefix + count * item_length
    assert split.usage.computed_tokens == 3 * prefix + count * item_length
    assert split.usage.prompt_tokens == whole.usage.prompt_tokens == count * (prefix + item_length)


def test_multi_item_off_or_reference_runner_compute_every_pair(lm_path, lm, reference):
    request = ScoreRequest(query=QUERY, items=DOCS, template="qwen3-reranker")
    off = lm.score(request.model_copy(update={"multi_item": False}))
    assert off.usage.computed_tokens == off.usage.prompt_tokens
    assert reference.score(request).usage.computed_tokens == off.usage.prompt_tokens
    assert lm.score(request).usage.computed_tokens < off.usage.prompt_tokens
    cpu_default = EmbeddedBackend(str(lm_path), device="cpu")  # span-wise SDPA: MIS costs less than pairs on CPU too
    assert cpu_default.runner == "packed" and cpu_default.score(request).usage == lm.score(request).usage
    cpu_off = EmbeddedBackend(str(lm_path), device="cpu", multi_item=False)
    assert cpu_off.score(request).usage == off.usage


def sglang_multi_item_scores(model, query: list[int], items: list[list[int]], delimiter: int,
                             labels: list[int]) -> torch.Tensor:
    """SGLang's multi-item scoring, written out: ``query<d>item1<d>...<d>`` in one forward.

    As SGLang sets it up for FlashInfer (``_process_multi_item_scoring``, MaskMode::kMultiItemScoring): the prefix
    is the query (up to the first delimiter); a token at ``pos`` within its item (its delimiter is 0) sees the prefix
    and the keys after its delimiter up to itself, and sits at position ``prefix + pos - 1``. Label log-probs are
    read from the token before each delimiter that follows an item.
    """
    ids = list(query)
    delimiters = []
    for item in items:
        delimiters.append(len(ids))
        ids += [delimiter, *item]
    delimiters.append(len(ids))
    ids.append(delimiter)
    prefix, total = len(query), len(ids)
    within = torch.zeros(total, dtype=torch.long)
    for start, end in zip(delimiters, delimiters[1:] + [total]):
        within[start:end] = torch.arange(end - start)
    positions = torch.arange(total)
    positions[prefix:] = prefix + within[prefix:] - 1
    rows, keys = torch.arange(total)[:, None], torch.arange(total)[None, :]
    seen = (keys <= rows) & ((rows < prefix) | (keys < prefix) | (keys > rows - within[:, None]))
    mask = torch.zeros(total, total).masked_fill(~seen, float("-inf"))[None, None]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), position_ids=positions[None], attention_mask=mask).logits[0]
    reads = torch.tensor(delimiters[1:]) - 1
    return logits[reads][:, labels].float().log_softmax(-1)[:, 0].exp()


def test_raw_delimiter_mis_scores_as_sglang_does(lm_path, lm, reference):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm_path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(3)
    for _ in range(3):
        plain = random_raw_request(rng, lm._model().vocab_size, items=rng.randint(2, 6), add_special_tokens=False)
        delimited = plain.model_copy(update={"mis_delimiter_token_id": 3})
        expected = sglang_multi_item_scores(model, plain.query, plain.items, 3, plain.label_token_ids)
        for backend in (lm, reference):
            torch.testing.assert_close(torch.tensor(backend.score(delimited).scores), expected, atol=EXACT, rtol=0)
        # SGLang's delimiters are never attended to: the scores are those of the plain raw pairs.
        assert_same_results(lm.score(delimited), lm.score(plain))


def test_raw_delimiter_request_is_laid_out_as_its_query_and_item_pairs(lm):
    loaded = lm._model()
    room = loaded.max_length - 3
    request = ScoreRequest(query=[5, 6, 7], items=[[8, 9], [10], [11] * room], label_token_ids=[30, 31],
                           mis_delimiter_token_id=3, truncation="none")
    encoded = encode_request(request, loaded, "generative", get_template("raw"))
    assert (encoded.prefix_ids, encoded.item_ids, encoded.suffix_ids) == ([5, 6, 7], request.items, [])
    with pytest.raises(InvalidRequest, match="items\\[0\\]"):  # the item's room is what the query leaves
        encode_request(request.model_copy(update={"items": [[11] * (room + 1)]}), loaded, "generative",
                       get_template("raw"))
    with pytest.raises(InvalidRequest, match="mis_delimiter_token_id"):
        encode_request(request.model_copy(update={"mis_delimiter_token_id": loaded.vocab_size}), loaded,
                       "generative", get_template("raw"))


def test_score_batch_equals_separate_calls_in_fewer_micro_batches(lm_path):
    backend = EmbeddedBackend(str(lm_path), device="cpu", runner="packed", multi_item=True, max_batch_tokens=300)
    vocab = backend._model().vocab_size
    rng = random.Random(5)
    requests = [
        ScoreRequest(query=QUERY, items=DOCS, template="qwen3-reranker", return_label_logprobs=True),
        ScoreRequest(query="What is gravity?", items=DOCS[::-1], template="qwen3-reranker", apply_softmax=False),
        random_raw_request(rng, vocab, items=9),
        random_raw_request(rng, vocab, items=1),
        random_raw_request(rng, vocab, items=5, multi_item=False),
        ScoreRequest(query=QUERY, items=DOCS[:3], template="qwen3-reranker", multi_item=False),
    ]
    launches: list[int] = []
    forward_read = backend._runner.forward_read
    backend._runner.forward_read = lambda batch: (launches.append(batch.num_tokens), forward_read(batch))[1]
    together = backend.score_batch(requests)
    merged = len(launches)
    separate = [backend.score(request) for request in requests]
    for response, expected in zip(together, separate):
        assert_same_results(response, expected) if expected.results[0].label_logprobs else torch.testing.assert_close(
            torch.tensor(response.scores), torch.tensor(expected.scores), atol=EXACT, rtol=0)
        assert response.usage.prompt_tokens == expected.usage.prompt_tokens
    assert merged < len(launches) - merged
    assert max(launches) <= 300


def test_score_batch_reports_bad_requests_in_place_or_raises_before_running(lm):
    good = ScoreRequest(query=QUERY, items=DOCS[:2], template="qwen3-reranker")
    bad = ScoreRequest(query=[1, 2], items=[[10**7]], label_token_ids=[30, 31])
    outcomes = lm.score_batch([good, bad, good], return_exceptions=True)
    assert isinstance(outcomes[1], InvalidRequest) and "items[0]" in str(outcomes[1])
    assert outcomes[0].scores == pytest.approx(lm.score(good).scores, abs=EXACT) == outcomes[2].scores
    calls: list[int] = []
    forward_read = lm._runner.forward_read
    lm._runner.forward_read = lambda batch: (calls.append(1), forward_read(batch))[1]
    try:
        with pytest.raises(InvalidRequest):
            lm.score_batch([good, bad])
    finally:
        lm._runner.forward_read = forward_read
    assert not calls


def random_parts(rng: random.Random, causal: bool, typed: bool, head_count: int) -> RequestParts:
    def ids(length):
        return np.array([rng.randrange(1, 1000) for _ in range(length)], dtype=np.int64)

    items = [ids(rng.choice([1, rng.randint(1, 25)])) for _ in range(rng.randint(1, 9))]
    prefix, suffix = ids(rng.randint(1 if causal else 0, 20)), ids(rng.randint(0, 4))
    return RequestParts(prefix, items, suffix, read_first=not causal and rng.random() < 0.5,
                        share_prefix=causal and len(items) > 1 and rng.random() < 0.7,
                        head=rng.randrange(head_count), own_batches=rng.random() < 0.2,
                        prefix_types=np.zeros(len(prefix), dtype=np.int64) if typed else None, item_type=1,
                        suffix_types=np.ones(len(suffix), dtype=np.int64) if typed else None)


def reads_with_their_own_pairs(micro, requests: list[RequestParts]) -> list[tuple[int, int]]:
    """(request, item) of each read of ``micro``, after checking that the read sees its own pair and nothing else:
    its tokens, positions 0.., segment ids, and the read at the pair's last (or first) token."""
    batch = micro.batch
    allowed = attention_allowed(batch)
    seen = []
    for read, index, item in zip(batch.read_positions.tolist(), micro.read_requests.tolist(),
                                 micro.read_items.tolist()):
        parts = requests[index]
        pair = np.concatenate([parts.prefix, parts.items[item], parts.suffix]).tolist()
        visible = allowed[read].nonzero().flatten()
        assert batch.input_ids[visible].tolist() == pair
        assert batch.position_ids[visible].tolist() == list(range(len(pair)))
        if batch.token_type_ids is not None:
            types = [0] * len(parts.prefix) + [1] * len(parts.items[item]) + [1] * len(parts.suffix)
            assert batch.token_type_ids[visible].tolist() == types
        offset = 0 if parts.read_first else len(pair) - 1
        assert batch.position_ids[read] == offset
        seen.append((index, item))
    return seen


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded", [True, False])
def test_every_item_is_planned_once_and_sees_exactly_its_own_pair(causal, padded):
    rng = random.Random(int(causal) + 2 * int(padded))
    for budget in (1, 5, 37, 200, 10**6):
        typed = not causal and budget % 2 == 1  # segment ids come with the tokenizer: all requests or none
        requests = [random_parts(rng, causal, typed, head_count=3) for _ in range(rng.randint(1, 6))]
        if padded:
            for parts in requests:
                parts.share_prefix = False
        seen: list[tuple[int, int]] = []
        for micro in plan_requests(requests, budget, padded=padded, causal=causal):
            batch = micro.batch
            lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
            cost = max(lengths) * len(lengths) if padded else sum(lengths)
            assert cost <= budget or len(lengths) == 1
            owners = set(micro.read_requests.tolist())
            assert len(owners) == 1 or not any(requests[index].own_batches for index in owners)
            heads = [requests[index].head for index in micro.read_requests.tolist()]
            assert [key for key, start, end in micro.head_slices for _ in range(end - start)] == heads
            # The attention kernel picks its tiles by the mean number of keys a query sees under the mask.
            assert batch.keys_per_query == pytest.approx(attention_allowed(batch).sum().item() / batch.num_tokens)
            seen += reads_with_their_own_pairs(micro, requests)
        assert sorted(seen) == [(index, item) for index, parts in enumerate(requests)
                                for item in range(len(parts.items))]


@pytest.mark.parametrize("typed", [True, False])
def test_pairs_laid_out_together_equal_pairs_laid_out_one_by_one(typed):
    """``_Builder.add_pairs`` (whole arrays for a micro-batch's pairs) builds what one ``add_sequence`` a pair did:
    the same tokens, positions, types, sequences, reads and tokens per request."""
    from rerankit.engine.plan import _Builder

    rng = random.Random(7 + typed)
    requests = [random_parts(rng, causal=False, typed=typed, head_count=3) for _ in range(5)]
    for index, parts in enumerate(requests):
        parts.item_offset = 3 * index
    units = [(index, parts, item) for index, parts in enumerate(requests) for item in range(len(parts.items))]
    rng.shuffle(units)
    together, one_by_one = _Builder(), _Builder()
    together.add_pairs(units, [parts.pair_length(item) for _, parts, item in units])
    for index, parts, item in units:
        types = None if not typed else [parts.prefix_types, np.full(len(parts.items[item]), parts.item_type),
                                        parts.suffix_types]
        one_by_one.add_sequence(index, parts.head, [parts.prefix, parts.items[item], parts.suffix], types,
                                0 if parts.read_first else parts.pair_length(item) - 1, item + parts.item_offset)
    first, second = together.build(False, False), one_by_one.build(False, False)
    for name in ("input_ids", "position_ids", "cu_seqlens", "prefix_lens", "span_starts", "read_positions",
                 "token_type_ids"):
        assert torch.equal(getattr(first.batch, name), getattr(second.batch, name)) if typed or \
            name != "token_type_ids" else first.batch.token_type_ids is second.batch.token_type_ids is None
    assert first.batch.max_seqlen == second.batch.max_seqlen
    assert first.batch.keys_per_query == second.batch.keys_per_query
    assert np.array_equal(first.read_requests, second.read_requests)
    assert np.array_equal(first.read_items, second.read_items)
    assert first.head_slices == second.head_slices and first.request_tokens == second.request_tokens


@pytest.mark.gpu
def test_gpu_mis_follows_per_pair_scoring_in_bfloat16(lm_path):
    backend = EmbeddedBackend(str(lm_path), device="cuda")
    exact = EmbeddedBackend(str(lm_path), device="cuda", dtype="float32", runner="reference")
    rng = random.Random(7)
    for request in [ScoreRequest(query=QUERY, items=DOCS, template="qwen3-reranker"),
                    *(random_raw_request(rng, backend._model().vocab_size, items=12) for _ in range(3))]:
        shared = backend.score(request)
        torch.testing.assert_close(torch.tensor(shared.scores), torch.tensor(exact.score(request).scores),
                                   atol=2e-2, rtol=0)
        assert shared.usage.computed_tokens < shared.usage.prompt_tokens


def test_an_empty_item_scores_as_it_does_alone_wherever_it_lies(lm, reference):
    """An empty item with no suffix (raw scoring) is a span of no tokens: it is read at the prefix's last token,
    as the query alone is, never at the item before it (``test_overlap`` checks the positions in a continued
    sequence)."""
    items = ["Paris is in France.", "", "Beijing", "", ""]
    request = ScoreRequest(query="capital of France", items=items, label_token_ids=[5, 6])
    alone = lm.score(ScoreRequest(query="capital of France", items=[""], label_token_ids=[5, 6])).scores[0]
    scores = lm.score(request).scores
    assert scores == pytest.approx(reference.score(request).scores, abs=EXACT)
    assert [scores[index] for index in (1, 3, 4)] == pytest.approx([alone] * 3, abs=EXACT)
    assert abs(scores[1] - scores[0]) > EXACT


def test_an_empty_item_of_a_classifier_without_template_scores_as_alone(tiny_qwen3_classifier):
    backend = EmbeddedBackend(str(tiny_qwen3_classifier), device="cpu", runner="packed", multi_item=True)
    alone = backend.score(ScoreRequest(query="capital of France", items=[""])).scores[0]
    scores = backend.score(ScoreRequest(query="capital of France", items=["Beijing gravity", ""])).scores
    assert scores[1] == pytest.approx(alone, abs=EXACT) and abs(scores[0] - scores[1]) > EXACT


def test_a_template_on_an_encoder_cross_encoder_is_refused(tiny_bert_cross_encoder):
    """BERT reads [CLS] of the pair its tokenizer lays out; a template's text has neither, and its last token was
    read: refused, per request and as a backend default."""
    from rerankit.errors import ModelLoadError

    template = {"name": "plain-text", "prefix_format": "{query} ", "item_format": "{doc}", "suffix_format": "",
                "labels": ["yes"]}
    backend = EmbeddedBackend(str(tiny_bert_cross_encoder), device="cpu")
    with pytest.raises(InvalidRequest, match="takes no template") as error:
        backend.score(ScoreRequest(query="q", items=["d"], template=template))
    assert error.value.field == "template"
    with pytest.raises(ModelLoadError, match="takes no template"):
        EmbeddedBackend(str(tiny_bert_cross_encoder), device="cpu", template="qwen3-reranker")
