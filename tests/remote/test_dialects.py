"""The wire dialects as pure functions: request bodies checked against the peers' strict models, responses
decoded back to input order, refusals of fields a server cannot honour, and the server side of each."""

from __future__ import annotations

import math
import random

import pytest
from wire_models import ERROR_MODELS, REQUEST_MODELS, RESPONSE_MODELS, SORTED_RESPONSES

from rerankit.errors import InvalidRequest, RemoteError
from rerankit.remote.dialects import DIALECTS, get_dialect, read_error
from rerankit.schema import ScoreRequest, ScoreResponse, ScoreResult, Usage

DOCS = ["Paris is the capital of France.", "Berlin is in Germany.", "Bananas are yellow.", "Lyon is a city."]
TEXT_DIALECTS = ("vllm-score", "vllm-rerank", "sglang-rerank", "cohere", "jina", "tei")
LABEL_DIALECTS = ("vllm-generative", "sglang-score")


def request_for(dialect: str, **fields) -> ScoreRequest:
    """A request every dialect accepts: label ids for the generative ones; NIM's as its clients ask (logits)."""
    if dialect in LABEL_DIALECTS:
        fields.setdefault("label_token_ids", [9454, 2753])
    if dialect == "nim":
        fields.setdefault("raw_scores", True)
    return ScoreRequest(query="capital of France", items=DOCS, **fields)


def wire_entries(body) -> list:
    """The result entries of a rerank-style wire body, in the body's order."""
    if isinstance(body, list):
        return body
    for key in ("rankings", "data"):
        if key in body:
            return body[key]
    return body["results"]


def response_for(request: ScoreRequest, scores: list[float]) -> ScoreResponse:
    return ScoreResponse(results=[ScoreResult(index=i, score=s) for i, s in enumerate(scores)], model="m",
                         usage=Usage(prompt_tokens=40, computed_tokens=30))


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_request_body_is_valid_for_the_peer(name):
    dialect = get_dialect(name)
    path, body = dialect.encode_request(request_for(name, top_n=2), "served-model")
    assert path in dialect.paths
    REQUEST_MODELS[name].model_validate(body)
    assert "top_n" not in body, "every item must come back; ranked() cuts"


def test_generative_bodies_carry_labels_softmax_and_order():
    request = ScoreRequest(query=[1, 2, 3], items=[[4, 5], [6]], label_token_ids=[7, 8], apply_softmax=False,
                           item_first=True)
    _, vllm = get_dialect("vllm-generative").encode_request(request, None)
    assert vllm == {"query": [1, 2, 3], "items": [[4, 5], [6]], "label_token_ids": [7, 8], "apply_softmax": False,
                    "item_first": True, "add_special_tokens": True}
    _, sglang = get_dialect("sglang-score").encode_request(request.model_copy(update={"apply_softmax": True}), "m")
    # SGLang's default apply_softmax is false: rerankit's true must be sent explicitly.
    assert sglang["apply_softmax"] is True and sglang["label_token_ids"] == [7, 8] and sglang["model"] == "m"


def test_truncation_and_document_cap_map_to_each_wire():
    capped = ScoreRequest(query="q", items=DOCS, max_tokens_per_item=64)
    assert get_dialect("vllm-score").encode_request(capped, None)[1]["max_tokens_per_doc"] == 64
    assert get_dialect("vllm-rerank").encode_request(capped, None)[1]["truncate_prompt_tokens"] == -1
    assert get_dialect("cohere").encode_request(capped, None)[1]["max_tokens_per_doc"] == 64
    tei = get_dialect("tei")
    assert tei.encode_request(ScoreRequest(query="q", items=DOCS, truncation="start"), None)[1][
        "truncation_direction"] == "Left"
    assert tei.encode_request(ScoreRequest(query="q", items=DOCS, truncation="none"), None)[1]["truncate"] is False


def test_instruction_travels_where_the_wire_has_it():
    request = ScoreRequest(query="q", items=DOCS, instruction="Find the capital")
    assert get_dialect("vllm-rerank").encode_request(request, None)[1]["instruction"] == "Find the capital"
    assert get_dialect("sglang-rerank").encode_request(request, None)[1]["instruct"] == "Find the capital"


def test_text_template_is_rendered_for_raw_servers():
    request = ScoreRequest(query="capital of France", items=DOCS[:2], template="qwen3-reranker",
                           label_token_ids=[9693, 2152], instruction="Judge the document")
    _, body = get_dialect("vllm-generative").encode_request(request, None)
    REQUEST_MODELS["vllm-generative"].model_validate(body)
    assert "<Query>: capital of France" in body["query"] and "Judge the document" in body["query"]
    assert body["items"][0].startswith("<Document>: Paris")
    assert all(item.endswith("<think>\n\n</think>\n\n") for item in body["items"])


# Refusals: (dialect, field, value) that the peer cannot honour.
REFUSALS = [
    ("vllm-generative", "label_token_ids", None),
    ("vllm-generative", "labels", ["yes", "no"]),
    ("vllm-generative", "mode", "cross-encoder"),
    ("vllm-generative", "instruction", "be strict"),
    ("vllm-generative", "return_pooled_hidden_states", True),
    ("vllm-generative", "return_label_logprobs", True),
    ("vllm-generative", "max_tokens_per_item", 32),
    ("vllm-generative", "truncation", "none"),
    ("vllm-generative", "mis_delimiter_token_id", 151643),
    ("sglang-score", "labels", ["yes", "no"]),
    ("sglang-score", "add_special_tokens", False),
    ("sglang-score", "instruction", "be strict"),
    ("sglang-score", "max_tokens_per_item", 32),
    ("sglang-score", "truncation", "start"),
    ("sglang-score", "mode", "bi-encoder"),
]
for _name in TEXT_DIALECTS:
    REFUSALS += [(_name, "label_token_ids", [1, 2]), (_name, "apply_softmax", False), (_name, "item_first", True),
                 (_name, "return_pooled_hidden_states", True), (_name, "return_label_logprobs", True),
                 (_name, "template", "qwen3-reranker"), (_name, "mode", "generative" if _name != "sglang-rerank"
                                                         else "bi-encoder"),
                 (_name, "query", [1, 2, 3]), (_name, "items", [[1, 2], [3]])]
REFUSALS += [("vllm-score", "truncation", "start"), ("vllm-rerank", "add_special_tokens", False),
             ("cohere", "instruction", "x"), ("tei", "instruction", "x"), ("tei", "max_tokens_per_item", 32),
             ("sglang-rerank", "max_tokens_per_item", 32), ("cohere", "truncation", "start"),
             ("jina", "instruction", "x"), ("jina", "max_tokens_per_item", 32), ("jina", "truncation", "start")]


@pytest.mark.parametrize(("name", "field", "value"), REFUSALS)
def test_dialect_refuses_what_its_server_cannot_honour(name, field, value):
    fields = {"query": "q", "items": DOCS}
    if name in LABEL_DIALECTS:
        fields["label_token_ids"] = [1, 2]
    fields[field] = value
    if field == "labels":
        fields.pop("label_token_ids", None)
    with pytest.raises(InvalidRequest) as refused:
        get_dialect(name).encode_request(ScoreRequest(**fields), None)
    assert refused.value.field == field


@pytest.mark.parametrize("name", TEXT_DIALECTS)
def test_request_breaking_two_limits_gets_the_same_refusal_on_every_text_route(name):
    request = ScoreRequest(query="q", items=DOCS, item_first=True, apply_softmax=False)
    with pytest.raises(InvalidRequest) as refused:
        get_dialect(name).encode_request(request, None)
    assert refused.value.field == "apply_softmax"


def test_classifier_on_sglang_score_refuses_label_logprobs_without_labels():
    request = ScoreRequest(query="q", items=DOCS, return_label_logprobs=True)
    with pytest.raises(InvalidRequest, match="return_label_logprobs"):
        get_dialect("sglang-score").encode_request(request, None)


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_server_answer_decodes_to_input_order(name):
    dialect = get_dialect(name)
    request = request_for(name)
    scores = [0.2, 0.9, 0.05, 0.6]
    body = dialect.encode_response(response_for(request, scores), request, "served-model", list(request.items))
    RESPONSE_MODELS[name].model_validate(body)
    decoded = dialect.decode(body, request)
    assert decoded.scores == pytest.approx(scores)
    assert [result.index for result in decoded.results] == [0, 1, 2, 3]
    if name in SORTED_RESPONSES:
        assert [entry["index"] for entry in wire_entries(body)] == [1, 3, 0, 2]


@pytest.mark.parametrize("name", sorted(SORTED_RESPONSES))
def test_sorted_wire_results_are_cut_to_top_n(name):
    dialect = get_dialect(name)
    request = request_for(name, top_n=2) if name != "tei" else request_for(name)
    body = dialect.encode_response(response_for(request, [0.2, 0.9, 0.05, 0.6]), request, "m")
    assert len(wire_entries(body)) == (4 if name == "tei" else 2)


def _shuffled_wire(name: str, indices: list[int]):
    """A peer's answer naming the given indices (scores are arbitrary)."""
    if name in ("vllm-generative", "vllm-score"):
        return {"data": [{"index": i, "object": "score", "score": 0.5} for i in indices], "model": "m"}
    if name in ("vllm-rerank", "cohere"):
        return {"results": [{"index": i, "relevance_score": 0.5} for i in indices]}
    return [{"index": i, "score": 0.5} for i in indices]


@pytest.mark.parametrize("name", ["vllm-generative", "vllm-score", "vllm-rerank", "sglang-rerank", "cohere", "tei"])
@pytest.mark.parametrize("indices", [[0, 1, 2], [0, 1, 2, 3, 3], [3, 2, 1, 0, 4], [0, 1, 2, 2]])
def test_every_item_must_come_back_exactly_once(name, indices):
    with pytest.raises(RemoteError):
        get_dialect(name).decode(_shuffled_wire(name, indices), request_for(name))


def test_shuffled_indices_are_restored():
    order = [2, 0, 3, 1]
    body = {"results": [{"index": i, "relevance_score": float(i)} for i in order]}
    assert get_dialect("cohere").decode(body, request_for("cohere")).scores == [0.0, 1.0, 2.0, 3.0]


def test_sglang_score_count_and_label_logprobs():
    dialect = get_dialect("sglang-score")
    request = ScoreRequest(query="q", items=DOCS[:2], label_token_ids=[1, 2], return_label_logprobs=True)
    decoded = dialect.decode({"scores": [[0.75, 0.25], [0.0, 1.0]], "model": "m", "object": "scoring"}, request)
    assert decoded.scores == [0.75, 0.0]
    assert decoded.results[0].label_logprobs == pytest.approx([math.log(0.75), math.log(0.25)])
    assert decoded.results[1].label_logprobs[0] == -math.inf
    with pytest.raises(RemoteError, match="1 scores for 2 items"):
        dialect.decode({"scores": [[0.5, 0.5]]}, request)


@pytest.mark.parametrize("logits", [[0.0, math.inf], [-math.inf], [math.nan, 0.2], [], ["1.0"], [True]])
def test_sglang_score_logits_that_are_not_finite_numbers_are_a_remote_error(logits):
    dialect = get_dialect("sglang-score")
    request = ScoreRequest(query="q", items=["a", "b"])  # a classifier: its logits go through the activation
    with pytest.raises(RemoteError, match="for item 0: not finite numbers"):
        dialect.decode({"scores": [logits, [0.2]]}, request)


def test_malformed_answer_is_a_remote_error():
    with pytest.raises(RemoteError, match="malformed vllm-score"):
        get_dialect("vllm-score").decode({"data": [{"index": 0, "score": "high"}]}, request_for("vllm-score"))
    with pytest.raises(RemoteError, match="malformed tei"):
        get_dialect("tei").decode({"error": "no"}, request_for("tei"))



@pytest.mark.parametrize("body", [
    {"data": [{"index": i, "object": "score", "score": 10 ** 400 if i == 0 else 0.5} for i in range(4)]},
    {"data": [{"index": i, "object": "score", "score": 0.5} for i in range(4)], "usage": {"prompt_tokens": math.inf}},
])
def test_numbers_out_of_range_are_a_remote_error(body):
    with pytest.raises(RemoteError, match="malformed vllm-score"):
        get_dialect("vllm-score").decode(body, request_for("vllm-score"))

# Server side -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_client_body_parses_back_to_the_same_request(name):
    fields = {"instruction": "Find it"} if name in ("vllm-score", "vllm-rerank", "sglang-rerank") else {}
    if name in ("vllm-score", "vllm-rerank", "cohere"):
        fields["max_tokens_per_item"] = 100
    request = request_for(name, **fields)
    parsed = get_dialect(name).parse_request(get_dialect(name).encode_request(request, "m")[1])
    for field in ("query", "items", "label_token_ids", "apply_softmax", "item_first", "instruction",
                  "max_tokens_per_item", "truncation", "add_special_tokens"):
        assert getattr(parsed, field) == getattr(request, field), field


# (dialect, wire body, the wire field the error must name)
BAD_BODIES = [
    ("vllm-generative", {"query": "q", "items": [], "label_token_ids": [1]}, "items"),
    ("vllm-generative", {"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
    ("vllm-generative", {"query": "q", "items": ["a"]}, "label_token_ids"),
    ("vllm-score", {"queries": ["q1", "q2"], "documents": ["a", "b"]}, "queries"),
    ("vllm-score", {"data_1": "q", "data_2": []}, "data_2"),
    ("vllm-rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 128}, "truncate_prompt_tokens"),
    ("vllm-rerank", {"query": "q", "documents": ["a"], "padding": "max_length"}, "padding"),
    ("vllm-rerank", {"query": "q", "documents": ["a"], "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
    ("sglang-score", {"query": "q", "items": ["a"], "label_token_ids": [1], "temperature": 0.5}, "temperature"),
    ("sglang-score", {"query": "q", "items": ["a"], "label_token_ids": [[1], [2]]}, "label_token_ids"),
    ("sglang-score", {"query": "q", "items": ["a"], "embed_override_token_id": 0}, "embed_override_token_id"),
    ("sglang-rerank", {"query": "q", "documents": [""], "top_n": 0}, "top_n"),
    ("cohere", {"query": "q", "documents": [{"body": "a"}], "rank_fields": ["title"]}, "documents"),
    ("cohere", {"query": "q", "documents": [{"title": "a"}]}, "documents"),
    ("cohere", {"query": "q", "documents": ["a", 3]}, "documents"),
    ("cohere", {"query": "q", "documents": ["a"], "max_chunks_per_doc": 0}, "max_chunks_per_doc"),
    ("cohere", {"query": "  ", "documents": ["a"]}, "query"),
    ("tei", {"query": "q", "texts": []}, "texts"),
]


@pytest.mark.parametrize(("name", "body", "field"), BAD_BODIES)
def test_bad_wire_body_names_the_wire_field(name, body, field):
    with pytest.raises(InvalidRequest) as refused:
        get_dialect(name).parse_request(body)
    assert refused.value.field.split(".")[0] == field


# (dialect, wire body, whether it asks for raw scores)
RAW_BODIES = [
    ("vllm-score", {"text_1": "q", "text_2": ["a"], "use_activation": False}, True),
    ("vllm-score", {"text_1": "q", "text_2": ["a"], "use_activation": True, "softmax": False}, False),
    ("vllm-rerank", {"query": "q", "documents": ["a"], "softmax": False}, True),
    ("vllm-rerank", {"query": "q", "documents": ["a"], "activation": False}, True),
    ("vllm-rerank", {"query": "q", "documents": ["a"], "use_activation": None, "activation": True}, False),
    ("infinity", {"query": "q", "documents": ["a"], "raw_scores": True}, True),
    ("tei", {"query": "q", "texts": ["a"], "raw_scores": True}, True),
    ("tei", {"query": "q", "texts": ["a"]}, False),
]


@pytest.mark.parametrize(("name", "body", "raw"), RAW_BODIES)
def test_a_body_asking_for_logits_parses_to_raw_scores(name, body, raw):
    """vLLM's use_activation (softmax and activation, its old names, where it is not given), TEI's and Infinity's
    raw_scores."""
    assert get_dialect(name).parse_request(body).raw_scores is raw


@pytest.mark.parametrize(("name", "field", "value"), [
    ("vllm-score", "use_activation", False), ("vllm-rerank", "use_activation", False),
    ("tei", "raw_scores", True), ("infinity", "raw_scores", True)])
def test_the_client_asks_a_server_for_raw_scores_in_its_own_words(name, field, value):
    _, body = get_dialect(name).encode_request(ScoreRequest(query="q", items=["a"], raw_scores=True), "m")
    assert body[field] is value


@pytest.mark.parametrize(("name", "labels"), [("cohere", None), ("sglang-rerank", None), ("vllm-generative", [1, 2]),
                                            ("sglang-score", [1, 2])])
def test_a_server_without_raw_scores_refuses_them_by_name(name, labels):
    with pytest.raises(InvalidRequest, match="cannot honour raw_scores=True: it returns activated scores only") as no:
        get_dialect(name).encode_request(ScoreRequest(query="q", items=["a"], label_token_ids=labels,
                                                      raw_scores=True), "m")
    assert no.value.field == "raw_scores"


def test_server_parse_fills_the_peers_defaults():
    vllm = get_dialect("vllm-generative").parse_request({"query": "q", "items": ["a"], "label_token_ids": [5]})
    assert (vllm.mode, vllm.template, vllm.apply_softmax) == ("generative", "raw", True)
    sglang = get_dialect("sglang-score").parse_request({"query": [1], "items": [[2]], "label_token_ids": [5, 6]})
    assert sglang.apply_softmax is False and sglang.return_label_logprobs is True
    rerank = get_dialect("vllm-rerank").parse_request({"query": "q", "documents": "a", "top_n": 0})
    assert rerank.items == ["a"] and rerank.top_n is None and rerank.truncation == "none"
    tei = get_dialect("tei").parse_request({"query": "q", "texts": ["a"], "truncate": True,
                                            "truncation_direction": "Left"})
    assert tei.truncation == "start"
    empty = get_dialect("vllm-score").parse_request({"queries": "q", "documents": ["a"], "chat_template_kwargs": {}})
    assert empty.items == ["a"], "an empty mapping is the same as leaving the field out"


def test_sglang_score_answers_every_label_probability():
    dialect = get_dialect("sglang-score")
    request = dialect.parse_request({"query": "q", "items": ["a", "b"], "label_token_ids": [5, 6],
                                     "apply_softmax": True})
    engine_answer = ScoreResponse(results=[
        ScoreResult(index=0, score=0.8, label_logprobs=[math.log(0.8), math.log(0.2)]),
        ScoreResult(index=1, score=0.3, label_logprobs=[math.log(0.3), math.log(0.7)])], model="m")
    body = dialect.encode_response(engine_answer, request)
    RESPONSE_MODELS["sglang-score"].model_validate(body)
    assert body["scores"] == [pytest.approx([0.8, 0.2]), pytest.approx([0.3, 0.7])]


@pytest.mark.parametrize("name", sorted(SORTED_RESPONSES - {"vllm-rerank", "nim"}))
def test_documents_come_back_only_when_asked(name):
    dialect = get_dialect(name)
    request = request_for(name)
    flag = {"sglang-rerank": "return_documents", "cohere": "return_documents", "jina": "return_documents",
            "tei": "return_text",
            "infinity": "return_documents", "voyage": "return_documents"}[name]
    field = "texts" if name == "tei" else "documents"
    scored = response_for(request, [0.1, 0.2, 0.3, 0.4])
    asked = dialect.encode_response(scored, request, "m", dialect.echoed_documents({field: DOCS, flag: True}))
    not_asked = dialect.encode_response(scored, request, "m", dialect.echoed_documents({field: DOCS, flag: False}))
    first_asked = wire_entries(asked)[0]
    first_not = wire_entries(not_asked)[0]
    assert set(first_asked) - set(first_not) in ({"document"}, {"text"})


def test_cohere_echoes_object_documents_whole():
    cohere = get_dialect("cohere")
    body = {"query": "q", "documents": [{"title": "A", "text": "a", "id": "7"}, "b"], "rank_fields": ["title"],
            "return_documents": True}
    request = cohere.parse_request(body)
    reply = cohere.encode_response(response_for(request, [0.9, 0.1]), request, "m", cohere.echoed_documents(body))
    assert [result["document"] for result in reply["results"]] == [{"title": "A", "text": "a", "id": "7"},
                                                                   {"text": "b"}]


@pytest.mark.parametrize(("chunks", "prompt_tokens", "units"), [
    (0, 0, 0), (1, 0, 1), (3, 21, 1), (100, 0, 1), (100, 50_000, 1), (101, 0, 2), (200, 0, 2), (201, 0, 3),
    (1, 600, 1), (100, 50_001, 2), (98, 98 * 512, 2), (2, 150_000, 3)])
def test_cohere_search_units_per_100_documents_of_500_token_chunks(chunks, prompt_tokens, units):
    from rerankit.remote.dialects.cohere import search_units

    assert search_units(chunks, prompt_tokens) == units


@pytest.mark.parametrize("path", ["/v2/rerank", "/v1/rerank"])
def test_cohere_replies_carry_billed_search_units_counting_windows(path):
    encode = get_dialect("cohere").at(path).encode_response
    request = request_for("cohere")
    one_each = encode(response_for(request, [0.1, 0.2, 0.3, 0.4]), request, "m")
    windowed = ScoreResponse(results=[ScoreResult(index=i, score=0.5, windows=30) for i in range(4)], model="m",
                             usage=Usage(prompt_tokens=4000, computed_tokens=4000))
    assert one_each["meta"]["billed_units"] == {"search_units": 1}
    assert encode(windowed, request, "m")["meta"]["billed_units"] == {"search_units": 2}


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_error_body_is_the_peers_format_and_reads_back(name):
    body = get_dialect(name).error_body(400, "must hold at least one item", "items")
    ERROR_MODELS[name].model_validate(body)
    message, _ = read_error(body)
    assert "must hold at least one item" in message


def test_read_error_understands_fastapi_validation_details():
    assert read_error({"detail": [{"loc": ["body", "query"], "msg": "Field required"}]}) == (
        "Field required", "body.query")
    assert read_error({"detail": "Not Found"}) == ("Not Found", None)
    assert read_error(["not", "an", "error"]) == (None, None)


def test_status_codes_give_openai_error_types():
    types = {status: get_dialect("vllm-score").error_body(status, "m")["error"]["type"]
             for status in (400, 404, 429, 503)}
    assert types == {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError",
                     503: "InternalServerError"}


def test_round_trip_keeps_scores_for_random_orders():
    rng = random.Random(5)
    for name in SORTED_RESPONSES:
        dialect = get_dialect(name)
        request = ScoreRequest(query="q", items=[f"doc {i}" for i in range(17)], raw_scores=name == "nim")
        scores = [rng.random() for _ in range(17)]
        body = dialect.encode_response(response_for(request, scores), request, "m")
        assert dialect.decode(body, request).scores == pytest.approx(scores)


# Accepting what the peers accept ---------------------------------------------------------------------------

# A body of each dialect with fields the peer ignores or sends as null (vLLM's model_dump sends every field).
EXTRA_FIELDS = {"some_future_field": 1, "user": None}


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_unknown_and_null_fields_are_ignored(name):
    dialect = get_dialect(name)
    _, body = dialect.encode_request(request_for(name), "m")
    parsed = dialect.parse_request({**body, **EXTRA_FIELDS})
    assert parsed.items == dialect.parse_request(body).items == DOCS


def test_cohere_v1_object_documents_score_their_rank_fields_as_lines():
    cohere = get_dialect("cohere")
    documents = [{"title": "Paris", "text": "Capital of France", "year": 1900}, {"text": "Bananas"}, "plain"]
    parsed = cohere.parse_request({"query": "q", "documents": documents, "rank_fields": ["title", "text", "year"],
                                   "max_chunks_per_doc": 3})
    assert parsed.items == ["title: Paris\ntext: Capital of France\nyear: 1900", "text: Bananas", "plain"]
    assert (parsed.long_documents, parsed.long_document_max_windows) == ("max", 3)  # best of at most 3 windows
    assert cohere.parse_request({"query": "q", "documents": documents[:2]}).items == ["Capital of France", "Bananas"]


# Which dialect answers a shared path ------------------------------------------------------------------------

def _pick(path: str, body: dict, headers: dict | None = None, default: str | None = None) -> str:
    from rerankit.server.routes import ROUTES, dialect_for

    dialects = [get_dialect(name) for name in ROUTES[path]]
    chosen = dialect_for(dialects, body, headers, get_dialect(default) if default else None)
    return chosen.name


BARE = {"query": "q", "documents": ["a", "b"]}
VLLM_DUMP = {**BARE, "model": "m", "top_n": 0, "user": None, "truncate_prompt_tokens": None, "max_tokens_per_query": 0,
             "max_tokens_per_doc": 0, "priority": 0, "padding": None}
PICKS = [
    ("/v1/rerank", BARE, None, None, "vllm-rerank"),
    ("/v1/rerank", {**BARE, "model": "m"}, None, None, "vllm-rerank"),
    ("/v1/rerank", BARE, None, "sglang-rerank", "sglang-rerank"),
    ("/v1/rerank", {**BARE, "model": "m"}, None, "sglang-rerank", "sglang-rerank"),
    ("/v1/rerank", {**BARE, "model": "m"}, {"x-fern-sdk-name": "cohere"}, None, "cohere"),
    ("/v1/rerank", {**BARE, "rank_fields": ["text"]}, None, None, "cohere"),
    ("/v1/rerank", {**BARE, "max_chunks_per_doc": 2}, None, None, "cohere"),
    ("/v1/rerank", {**BARE, "model": "m", "return_documents": True, "top_n": 2}, None, None, "jina"),
    ("/v1/rerank", {**BARE, "return_documents": False}, None, None, "sglang-rerank"),
    ("/v1/rerank", {**BARE, "instruct": "be strict", "model": "m"}, None, None, "sglang-rerank"),
    ("/v1/rerank", {**BARE, "model": "m", "return_documents": False, "raw_scores": False, "top_n": 2}, None, None,
     "infinity"),
    ("/v1/rerank", VLLM_DUMP, None, "sglang-rerank", "vllm-rerank"),
    ("/v1/rerank", {**BARE, "return_documents": None, "instruct": None}, None, None, "vllm-rerank"),
    ("/v2/rerank", {**BARE, "model": "m", "priority": 3, "max_tokens_per_doc": 100}, None, None, "cohere"),
    ("/v2/rerank", VLLM_DUMP, None, None, "vllm-rerank"),
    ("/v2/rerank", BARE, None, "vllm-rerank", "vllm-rerank"),
    ("/rerank", BARE, None, None, "vllm-rerank"),
    ("/rerank", {"query": "q", "texts": ["a"], "raw_scores": False}, None, None, "tei"),
    ("/rerank", {**BARE, "raw_scores": False, "return_documents": True, "model": "m"}, None, None, "infinity"),
    ("/rerank", {**BARE, "return_documents": True, "model": "m"}, None, None, "infinity"),  # LiteLLM's infinity/
    ("/v1/rerank", {**BARE, "model": "m", "top_k": None, "truncation": True}, None, None, "voyage"),  # voyageai
    ("/v1/rerank", {**BARE, "model": "m", "top_k": 1}, None, None, "voyage"),
    # LiteLLM's jina_ai provider; its azure_ai and litellm_proxy ones send the same body, meaning Cohere's v1 API
    ("/v1/rerank", {**BARE, "model": "m", "top_n": 1, "return_documents": True}, None, None, "jina"),
    ("/v1/rerank", {**BARE, "model": "m", "return_documents": True}, {"x-fern-sdk-name": "cohere"}, None, "cohere"),
    ("/v1/rerank", {**BARE, "model": "m", "return_documents": True, "rank_fields": ["text"]}, None, None, "cohere"),
    # a field of one dialect alone outweighs shared ones (return_documents is SGLang's, Infinity's, Cohere's...)
    ("/v1/rerank", {**BARE, "top_k": 1, "return_documents": True}, None, None, "voyage"),
    ("/v1/rerank", {**BARE, "model": "rerank-2", "top_k": 1, "truncation": True, "return_documents": True}, None, None,
     "voyage"),
    ("/v1/rerank", {**BARE, "rank_fields": ["title"], "return_documents": True}, None, None, "cohere"),
    ("/v1/rerank", {**BARE, "max_chunks_per_doc": 2, "return_documents": True}, None, None, "cohere"),
    ("/rerank", BARE, None, "infinity", "infinity"),
    ("/v1/score", {"query": "q", "items": ["a"]}, None, None, "sglang-score"),
    ("/v1/score", {"queries": "q", "items": ["a"]}, None, None, "vllm-score"),
    ("/v1/score", {"text_1": "q", "text_2": ["a"], "label_token_ids": None}, None, None, "vllm-score"),
]


@pytest.mark.parametrize(("path", "body", "headers", "default", "want"), PICKS)
def test_shared_path_answers_in_the_callers_dialect(path, body, headers, default, want):
    assert _pick(path, body, headers, default) == want


def test_rerank_dialect_setting_names_exactly_the_rerank_paths_dialects():
    from rerankit.server.limits import RERANK_DIALECTS, ServerConfig
    from rerankit.server.routes import ROUTES

    assert set(RERANK_DIALECTS) == {name for path in ("/rerank", "/v1/rerank", "/v2/rerank") for name in ROUTES[path]}
    with pytest.raises(ValueError, match="rerank_dialect"):
        ServerConfig(rerank_dialect="vllm-score")


# The client's body gives the true score under the peer's own semantics ----------------------------------------
# Each ``peer`` below answers a body as the peer's source does, from the model's raw outputs; the client's decode
# must give rerankit's score for the model's mode (sigmoid of a lone logit, softmax over labels...).

def _sigmoid(value: float) -> float:
    return 1 / (1 + math.exp(-value))


LOGITS = [2.5, -1.0, 0.0, 7.0]  # a one-logit cross-encoder's head, one per document
LABEL_LOGPROBS = [[-0.2, -1.9], [-2.5, -0.1], [-0.7, -0.8], [-3.0, -4.0]]  # log p(yes), log p(no) per document


def _label_values(apply_softmax: bool) -> list[list[float]]:
    if apply_softmax:
        return [[math.exp(lp) / sum(math.exp(x) for x in row) for lp in row] for row in LABEL_LOGPROBS]
    return [[math.exp(lp) for lp in row] for row in LABEL_LOGPROBS]


def test_sglang_score_cross_encoder_body_yields_the_heads_true_score():
    """SGLang 0.5.23 ``python/sglang/srt/managers/tokenizer_manager_score_mixin.py``: for a SequenceClassification
    model ``scores`` are the class logits, softmaxed over the classes when ``apply_softmax`` (a lone logit: 1.0)."""
    dialect = get_dialect("sglang-score")
    request = ScoreRequest(query="q", items=DOCS, mode="cross-encoder")
    _, body = dialect.encode_request(request, "m")
    assert body["apply_softmax"] is False and "label_token_ids" not in body

    def peer(body):
        if body["apply_softmax"]:
            return [[1.0] for _ in LOGITS]  # softmax over one value
        return [[logit] for logit in LOGITS]

    decoded = dialect.decode({"scores": peer(body), "model": "m", "object": "scoring"}, request)
    assert decoded.scores == pytest.approx([_sigmoid(logit) for logit in LOGITS])
    two_class = dialect.decode({"scores": [[0.0, logit] for logit in LOGITS]}, request)
    assert two_class.scores == pytest.approx([_sigmoid(logit) for logit in LOGITS]), "softmax's class 1"
    with pytest.raises(InvalidRequest, match="apply_softmax"):
        dialect.encode_request(request.model_copy(update={"apply_softmax": False}), None)


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_sglang_score_label_body_yields_the_true_label_probability(apply_softmax):
    """SGLang ``tokenizer_manager_score_mixin.py`` ``_convert_logprobs_to_scores``: softmax over the label logprobs
    when ``apply_softmax``, else ``exp(logprob)`` (full-vocabulary probability); default false."""
    dialect = get_dialect("sglang-score")
    request = ScoreRequest(query="q", items=DOCS, label_token_ids=[1, 2], apply_softmax=apply_softmax)
    _, body = dialect.encode_request(request, None)
    decoded = dialect.decode({"scores": _label_values(body["apply_softmax"])}, request)
    assert decoded.scores == pytest.approx([row[0] for row in _label_values(apply_softmax)])


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_vllm_generative_body_yields_the_true_label_probability(apply_softmax):
    """vLLM 0.33 ``vllm/entrypoints/openai/generative_scoring/serving.py``: ``apply_softmax`` (default true) is a
    softmax over the label ids, false the full-vocabulary probability; ``score`` is the first label's."""
    dialect = get_dialect("vllm-generative")
    request = ScoreRequest(query="q", items=DOCS, label_token_ids=[1, 2], apply_softmax=apply_softmax)
    _, body = dialect.encode_request(request, None)
    data = [{"index": i, "object": "score", "score": row[0]}
            for i, row in enumerate(_label_values(body.get("apply_softmax", True)))]
    assert dialect.decode({"data": data}, request).scores == pytest.approx(
        [row[0] for row in _label_values(apply_softmax)])


@pytest.mark.parametrize("name", ["vllm-score", "vllm-rerank"])
def test_vllm_pooling_body_keeps_the_heads_activation(name):
    """vLLM 0.33 ``vllm/entrypoints/pooling/score/protocol.py``: ``use_activation`` null or true applies the model's
    activation (sigmoid for one label), false answers raw logits; the client never sends false."""
    dialect = get_dialect(name)
    request = ScoreRequest(query="q", items=DOCS, mode="cross-encoder")
    _, body = dialect.encode_request(request, None)
    activate = body.get("use_activation") in (None, True)
    scores = [_sigmoid(logit) if activate else logit for logit in LOGITS]
    wire = ({"data": [{"index": i, "score": s} for i, s in enumerate(scores)]} if name == "vllm-score" else
            {"results": [{"index": i, "relevance_score": s} for i, s in enumerate(scores)]})
    assert dialect.decode(wire, request).scores == pytest.approx([_sigmoid(logit) for logit in LOGITS])


@pytest.mark.parametrize("name", ["tei", "infinity"])
def test_tei_and_infinity_bodies_ask_for_activated_scores(name):
    """TEI ``router/src/http/server.rs`` rerank and Infinity
    ``libs/infinity_emb/infinity_emb/fastapi_schemas/pymodels.py``
    ``RerankInput``: ``raw_scores`` false (the default) applies the sigmoid to a cross-encoder's logit."""
    dialect = get_dialect(name)
    request = ScoreRequest(query="q", items=DOCS)
    _, body = dialect.encode_request(request, None)
    scores = [logit if body.get("raw_scores") else _sigmoid(logit) for logit in LOGITS]
    wire = ([{"index": i, "score": s} for i, s in enumerate(scores)] if name == "tei" else
            {"results": [{"index": i, "relevance_score": s} for i, s in enumerate(scores)]})
    assert dialect.decode(wire, request).scores == pytest.approx([_sigmoid(logit) for logit in LOGITS])


def test_sglang_score_server_answers_classifier_logits_that_round_trip():
    """rerankit's own ``/v1/score`` answers ``apply_softmax: false`` for a classifier with the logit whose sigmoid is
    the engine's score (kept finite), so the client's activation gives the engine's score back."""
    dialect = get_dialect("sglang-score")
    request = ScoreRequest(query="q", items=DOCS, mode="cross-encoder")
    parsed = dialect.parse_request(dialect.encode_request(request, None)[1])
    engine = response_for(parsed, [0.25, 0.0, 1.0, 0.999])
    body = dialect.encode_response(engine, parsed)
    assert all(abs(values[0]) <= 100 for values in body["scores"])
    assert dialect.decode(body, request).scores == pytest.approx([0.25, 0.0, 1.0, 0.999], abs=1e-12)


# The OpenAPI request schemas -------------------------------------------------------------------------------

def test_openapi_publishes_each_paths_request_models_and_client_bodies_fit_them():
    jsonschema = pytest.importorskip("jsonschema")
    from rerankit.server.app import create_app
    from rerankit.server.routes import ROUTES

    class NoBackend:
        model_name = "m"

    spec = create_app(NoBackend()).openapi()
    for path, names in ROUTES.items():
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        titles = [part["title"] for part in (schema["anyOf"] if len(names) > 1 else [schema])]
        assert titles == [f"{name} request" for name in names]
        for name in names:
            _, body = get_dialect(name).encode_request(request_for(name), "m")
            jsonschema.validate(body, schema)


# A known field sent as null is as if left out -----------------------------------------------------------------

GOOD_BODIES = {
    "vllm-generative": {"query": "q", "items": ["a", "b"], "label_token_ids": [5, 6]},
    "vllm-score": {"queries": "q", "documents": ["a", "b"]},
    "vllm-rerank": {"query": "q", "documents": ["a", "b"]},
    "sglang-score": {"query": "q", "items": ["a", "b"], "label_token_ids": [5, 6]},
    "sglang-rerank": {"query": "q", "documents": ["a", "b"]},
    "cohere": {"model": "m", "query": "q", "documents": ["a", "b"]},
    "jina": {"model": "m", "query": "q", "documents": ["a", "b"]},
    "tei": {"query": "q", "texts": ["a", "b"]},
    "infinity": {"query": "q", "documents": ["a", "b"]},
    "nim": {"model": "m", "query": {"text": "q"}, "passages": [{"text": "a"}, {"text": "b"}]},
    "voyage": {"model": "m", "query": "q", "documents": ["a", "b"]},
}


def test_every_dialect_has_a_good_body():
    assert set(GOOD_BODIES) == set(DIALECTS)


@pytest.mark.parametrize("name", sorted(GOOD_BODIES))
def test_an_optional_field_sent_as_null_parses_as_if_left_out(name):
    dialect = get_dialect(name)
    body = GOOD_BODIES[name]
    alone = dialect.parse_request(body)
    optional = [field for field, info in dialect.request_body.model_fields.items()
                if not info.is_required() and field not in body]
    assert optional
    for field in optional:
        assert dialect.parse_request({**body, field: None}) == alone, field


@pytest.mark.parametrize("name", sorted(GOOD_BODIES))
def test_a_required_field_sent_as_null_is_refused_by_name(name):
    dialect = get_dialect(name)
    for field, info in dialect.request_body.model_fields.items():
        if info.is_required():
            with pytest.raises(InvalidRequest) as caught:
                dialect.parse_request({**GOOD_BODIES[name], field: None})
            assert caught.value.field.split(".")[0].split("[")[0] == field


def test_unknown_field_names_reach_the_debug_log_quoted_and_cut(caplog):
    import logging

    forged = "x\nINFO:     127.0.0.1:1 - \"POST /admin HTTP/1.1\" 200 OK\x1b[31m" + "y" * 5000
    body = {**GOOD_BODIES["vllm-rerank"], forged: 1, **{f"extra{n}": 1 for n in range(30)}}
    with caplog.at_level(logging.DEBUG, logger="rerankit"):
        get_dialect("vllm-rerank").parse_request(body)
    (line,) = [record.getMessage() for record in caplog.records if "unknown field" in record.getMessage()]
    assert "\n" not in line and "\x1b" not in line and len(line) < 2000 and "31 unknown field(s)" in line
