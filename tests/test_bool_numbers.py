"""A bool where a request asks for a number is refused, naming the field: pydantic's lax mode would take ``true``
as 1 (``top_n: true`` as one result). Every number field of ``ScoreRequest`` and of every dialect's wire body is
found by what pydantic alone would make of a bool there, so a field added later is checked too."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from rerankit.errors import InvalidRequest
from rerankit.remote.dialects import DIALECTS
from rerankit.schema import ScoreRequest

MODELS = {"ScoreRequest": ScoreRequest, **{f"{name} {dialect.request_body.__name__}": dialect.request_body
                                          for name, dialect in DIALECTS.items()}}
BOOLS = (True, False, [True], [[1, False]])


def _made_a_number(annotation, value) -> bool:
    """Whether pydantic, on its own, takes ``value`` (holding a bool) as a number for ``annotation``."""
    try:
        taken = TypeAdapter(annotation).validate_python(value)
    except ValidationError:
        return False
    return json.dumps(taken) != json.dumps(value)


def _number_fields():
    return [(model_name, field, value) for model_name, model in MODELS.items()
            for field, info in model.model_fields.items() for value in BOOLS if _made_a_number(info.annotation, value)]


def test_the_number_fields_are_found():
    found = {(model, field) for model, field, _ in _number_fields()}
    assert {("ScoreRequest", "top_n"), ("ScoreRequest", "query"), ("ScoreRequest", "label_token_ids"),
            ("cohere RerankBody", "top_n"), ("cohere RerankBody", "max_chunks_per_doc"),
            ("vllm-rerank RerankBody", "top_n"), ("vllm-generative GenerativeScoringBody", "label_token_ids"),
            ("sglang-score ScoreBody", "temperature"), ("voyage RerankBody", "top_k")} <= found


@pytest.mark.parametrize("model_name, field, value", _number_fields())
def test_a_bool_for_a_number_is_refused_naming_the_field(model_name, field, value):
    if model_name == "ScoreRequest":  # refuses its first fault, as an InvalidRequest: the other fields are good
        with pytest.raises(InvalidRequest) as refused:
            ScoreRequest(**{"query": "q", "items": ["a"], field: value})
        assert refused.value.field == field and "not a boolean" in refused.value.reason
        return
    with pytest.raises(ValidationError) as caught:  # a wire body: every fault, the missing fields' too
        MODELS[model_name].model_validate({field: value})
    mine = [error for error in caught.value.errors() if error["loc"] == (field,)]
    assert mine and "not a boolean" in mine[0]["msg"], caught.value.errors()


@pytest.mark.parametrize("fields", [{"top_n": True}, {"priority": False}, {"max_tokens_per_item": True},
                                    {"query": [1, True]}, {"query": [1], "items": [[2, False]]}])
def test_score_request_takes_no_bool_for_a_number(fields):
    with pytest.raises(InvalidRequest) as caught:
        ScoreRequest(**{"query": "q", "items": ["a"], **fields})
    assert caught.value.field == list(fields)[-1] and "not a boolean" in caught.value.reason


@pytest.mark.parametrize("fields", [{"top_n": 2}, {"top_n": "2"}, {"top_n": 2.0}, {"apply_softmax": False},
                                    {"query": [1, 2]}])
def test_numbers_and_bools_where_they_belong_are_taken(fields):
    ScoreRequest(**{"query": "q", "items": ["a", "b"], **fields})
