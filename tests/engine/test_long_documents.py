"""Long documents: windows scored and aggregated (max/mean) on both runners, and long texts tokenized from a
bounded slice (the same ids as the whole text, a multi-MB text refused or cut without tokenizing it whole)."""

from __future__ import annotations

import pytest

from rerankit.engine import EmbeddedBackend
from rerankit.engine import encode as encode_module
from rerankit.engine import lengths as lengths_module
from rerankit.engine.encode import encode_request
from rerankit.engine.resolve import resolve_template
from rerankit.engine.lengths import common_prefix
from rerankit.engine.load import load_model
from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreRequest

QUERY = [5, 17, 33, 8]
LABELS = [40, 41]
PROSE = ("Paris is the capital and most populous city of France, on the Seine; gravity attracts two bodies, "
         "and the quick brown fox jumps over the lazy dog 0123456789 times. ")


def _document(length: int, seed: int) -> list[int]:
    return [(seed * 7 + 13 * position) % 300 + 50 for position in range(length)]


@pytest.fixture(scope="module", params=["reference", "auto"])
def lm(request, tiny_qwen3_lm):
    return EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", runner=request.param)


def test_aggregated_score_is_the_max_or_mean_of_each_window_scored_alone(lm):
    documents = [_document(130, 1), _document(12, 2), _document(61, 3)]
    request = ScoreRequest(query=QUERY, items=documents, label_token_ids=LABELS, long_documents="max",
                           long_document_window=40, long_document_stride=30)
    by_max, by_mean = lm.score(request), lm.score(request.model_copy(update={"long_documents": "mean"}))
    # windows start every 30 tokens until one reaches the end: 130 -> 0,30,60,90; 12 -> one; 61 -> 0,30
    assert [result.windows for result in by_max.results] == [result.windows for result in by_mean.results] == [4, 1, 2]
    windows = [[document[start:start + 40] for start in range(0, max(len(document) - 40, 0) + 30, 30)]
               for document in documents]
    alone = lm.score(ScoreRequest(query=QUERY, items=[w for each in windows for w in each], label_token_ids=LABELS,
                                  multi_item=False)).scores
    for index, each in enumerate(windows):
        start = sum(map(len, windows[:index]))
        scores = alone[start:start + len(each)]
        assert by_max.results[index].score == pytest.approx(max(scores), abs=1e-5)
        assert by_mean.results[index].score == pytest.approx(sum(scores) / len(scores), abs=1e-5)


def test_windows_of_one_request_share_its_prefix_on_the_packed_runner(tiny_qwen3_lm):
    backend = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu")
    request = ScoreRequest(query=QUERY * 10, items=[_document(200, 4)], label_token_ids=LABELS,
                           long_documents="max", long_document_window=50, long_document_stride=50)
    usage = backend.score(request).usage
    assert backend.runner == "packed" and usage.computed_tokens < usage.prompt_tokens  # the query is run once


def test_max_windows_caps_the_windows_and_a_stride_over_the_window_is_refused(lm):
    request = ScoreRequest(query=QUERY, items=[_document(300, 5)], label_token_ids=LABELS, long_documents="max",
                           long_document_window=40, long_document_max_windows=3)
    assert lm.score(request).results[0].windows == 3
    with pytest.raises(InvalidRequest) as error:
        lm.score(request.model_copy(update={"long_document_stride": 41}))
    assert error.value.field == "long_document_stride"


def test_an_item_that_one_window_covers_never_meets_the_stride(lm):
    """The stride matters only between windows: an item cut (max_tokens_per_item) to one window scores as one that
    fits, whatever the stride (it was refused only when it had been longer than the cut)."""
    fields = dict(query=QUERY, label_token_ids=LABELS, long_documents="max", max_tokens_per_item=5,
                  long_document_stride=100_000)
    short, long = _document(4, 1), _document(40, 2)
    scored = lm.score(ScoreRequest(items=[short, long], **fields))
    assert [result.windows for result in scored.results] == [1, 1]
    cut = lm.score(ScoreRequest(items=[short, long], **{**fields, "long_documents": "truncate",
                                                        "long_document_stride": None}))
    assert scored.scores == pytest.approx(cut.scores, abs=1e-5)


def test_truncate_is_the_default_and_window_fields_need_a_windowed_mode():
    with pytest.raises(InvalidRequest) as error:
        ScoreRequest(query="q", items=["d"], long_document_window=10)
    assert error.value.field == "long_document_window"
    with pytest.raises(InvalidRequest) as error:
        ScoreRequest(query="q", items=["d"], long_documents="mean", return_label_logprobs=True)
    assert error.value.field == "long_documents"


def test_a_text_template_puts_the_document_lead_in_every_window(tiny_qwen3_lm):
    loaded = load_model(str(tiny_qwen3_lm), device="cpu")
    request = ScoreRequest(query="capital of France", items=[PROSE * 8], template="qwen3-reranker",
                           long_documents="max", long_document_window=60)
    encoded = encode_request(request, loaded, "generative", resolve_template(request, loaded, None, "generative"))
    empty_item = encode_module._tokenize(loaded.tokenizer, ["<Document>: "])[0]
    lead = encoded.item_ids[0][:common_prefix(encoded.item_ids[0], empty_item)]
    assert encoded.windows == [len(encoded.item_ids)] and len(encoded.item_ids) > 1 and lead
    assert all(window[:len(lead)] == lead and len(window) <= len(lead) + 60 for window in encoded.item_ids)


def _encode_items(loaded, request, mode, template=None):
    return encode_request(request, loaded, mode, template).item_ids


@pytest.mark.parametrize("fixture, mode, template", [
    ("tiny_qwen3_lm", "generative", "qwen3-reranker"),  # byte-level BPE, 2,048 tokens
    ("tiny_bert_cross_encoder", "cross-encoder", None),  # WordPiece, 512 tokens
])
@pytest.mark.parametrize("truncation", ["end", "start"])
def test_a_bounded_slice_gives_the_same_ids_as_the_whole_text(request, monkeypatch, fixture, mode, template,
                                                              truncation):
    loaded = load_model(str(request.getfixturevalue(fixture)), device="cpu")
    documents = [PROSE * 400, "  \n ".join([PROSE] * 300), PROSE]
    score_request = ScoreRequest(query="capital of France", items=documents, template=template,
                                 truncation=truncation)
    chosen = resolve_template(score_request, loaded, None, mode)
    bounded = _encode_items(loaded, score_request, mode, chosen)
    monkeypatch.setattr(lengths_module, "CHARS_PER_TOKEN", 10**9)  # no slice: every text tokenized whole
    assert bounded == _encode_items(loaded, score_request, mode, chosen)


def test_a_multi_megabyte_document_is_cut_or_refused_from_a_bounded_slice(monkeypatch, tiny_bert_cross_encoder):
    loaded = load_model(str(tiny_bert_cross_encoder), device="cpu")
    seen: list[int] = []
    tokenize = encode_module._tokenize
    monkeypatch.setattr(encode_module, "_tokenize",
                        lambda tokenizer, texts: seen.extend(map(len, texts)) or tokenize(tokenizer, texts))
    huge = PROSE * 30_000  # ~4 MB
    request = ScoreRequest(query="capital of France", items=[huge, "short"])
    items = _encode_items(loaded, request, "cross-encoder")
    assert len(items[0]) > 400 and max(seen) < 20 * loaded.max_length
    seen.clear()
    with pytest.raises(InvalidRequest) as error:
        _encode_items(loaded, request.model_copy(update={"truncation": "none"}), "cross-encoder")
    assert error.value.field == "items[0]" and max(seen) < 20 * loaded.max_length
    seen.clear()
    with pytest.raises(InvalidRequest) as error:
        _encode_items(loaded, ScoreRequest(query=huge, items=["d"]), "cross-encoder")
    assert error.value.field == "query" and max(seen) < 20 * loaded.max_length


def test_a_bi_encoders_long_query_is_cut_as_before_from_a_bounded_slice(monkeypatch):
    from rerankit.defaults import default_model_path

    loaded = load_model(default_model_path(), device="cpu", weights=False)
    request = ScoreRequest(query=PROSE * 3000, items=["d"])
    cut = encode_request(request, loaded, "bi-encoder", None).query_ids
    monkeypatch.setattr(lengths_module, "CHARS_PER_TOKEN", 10**9)
    assert len(cut) == loaded.max_length and cut == encode_request(request, loaded, "bi-encoder", None).query_ids


@pytest.mark.parametrize("dialect", ["vllm-generative", "vllm-rerank", "sglang-score", "sglang-rerank", "cohere",
                                     "tei"])
def test_remote_dialects_refuse_windowed_scoring_before_any_io(dialect):
    from rerankit.remote.dialects import get_dialect

    request = ScoreRequest(query="q", items=["d"], long_documents="max",
                           label_token_ids=LABELS if dialect in ("vllm-generative", "sglang-score") else None)
    with pytest.raises(InvalidRequest) as error:
        get_dialect(dialect).encode_request(request, None)
    assert error.value.field == "long_documents" and "rerankit serve" in error.value.reason


def test_a_template_given_by_its_pieces_is_rendered_for_a_raw_server():
    from rerankit.remote.dialects import get_dialect

    pieces = {"name": "mine", "prefix_format": "Q: {query}\n", "item_format": "D: {doc}", "suffix_format": "\nOK?",
              "labels": ["yes", "no"]}
    request = ScoreRequest(query="q", items=["d"], template=pieces, label_token_ids=LABELS)
    _, body = get_dialect("vllm-generative").encode_request(request, None)
    assert body["query"] == "Q: q\n" and body["items"] == ["D: d\nOK?"]


@pytest.mark.parametrize("per_item", [None, 40])
def test_windows_start_at_the_documents_start_whatever_its_length(monkeypatch, tiny_bert_cross_encoder, per_item):
    # truncation="start" with capped windows: a text long enough to be sliced is sliced on the side windows cover
    loaded = load_model(str(tiny_bert_cross_encoder), device="cpu")
    words = " ".join(f"w{index}" for index in range(2_000))
    request = ScoreRequest(query="capital of France", items=[words, " ".join(words.split()[:60])],
                           truncation="start", long_documents="max", long_document_window=16,
                           long_document_max_windows=2, max_tokens_per_item=per_item)
    sliced = _encode_items(loaded, request, "cross-encoder")
    monkeypatch.setattr(lengths_module, "CHARS_PER_TOKEN", 10**9)  # no slice: every text tokenized whole
    assert sliced == _encode_items(loaded, request, "cross-encoder")
    if per_item is None:  # both documents' windows cover the same first words
        assert sliced[:2] == sliced[2:]


def test_render_counts_a_multi_megabyte_documents_tokens_from_its_bounded_slice(monkeypatch, tiny_bert_cross_encoder):
    from rerankit.engine import render as render_module

    loaded = load_model(str(tiny_bert_cross_encoder), device="cpu")
    seen: list[int] = []
    tokenize = encode_module._tokenize

    def counted(tokenizer, texts):
        seen.extend(map(len, texts))
        return tokenize(tokenizer, texts)

    monkeypatch.setattr(encode_module, "_tokenize", counted)
    monkeypatch.setattr(render_module, "_tokenize", counted, raising=False)
    rendering = render_module.render_request(ScoreRequest(query="capital of France", items=[PROSE * 30_000, "short"]),
                                             loaded)
    huge, short = rendering.items
    assert max(seen) < 20 * loaded.max_length  # no text tokenized whole
    assert huge.document_tokens > loaded.max_length and huge.cut_tokens > 0
    assert short.cut_tokens == 0 and short.document_tokens == 1  # "short"
