"""Bad requests and unusable models fail with typed errors that name the field and the limit."""

from __future__ import annotations

import json

import pytest
import torch

from rerankit.engine import EmbeddedBackend
from rerankit.errors import InvalidRequest, ModelLoadError
from rerankit.schema import ScoreRequest


@pytest.fixture(scope="module")
def lm(tiny_qwen3_lm):
    return EmbeddedBackend(str(tiny_qwen3_lm), device="cpu")


@pytest.fixture(scope="module")
def embedder(tiny_bert_embedder):
    return EmbeddedBackend(str(tiny_bert_embedder), device="cpu")


@pytest.fixture(scope="module")
def cross_encoder(tiny_bert_cross_encoder):
    return EmbeddedBackend(str(tiny_bert_cross_encoder), device="cpu")


def refused(backend, field: str, **request) -> InvalidRequest:
    """The InvalidRequest raised by building or scoring ``request``, checked to name ``field``."""
    with pytest.raises(InvalidRequest) as caught:
        backend.score(ScoreRequest(**request))
    assert caught.value.field == field, caught.value
    return caught.value


def test_no_items_and_empty_query_are_refused(lm):
    refused(lm, "items", query="q", items=[])
    refused(lm, "query", query="  ", items=["d"])


def test_mixed_text_and_token_id_items_are_refused(lm):
    refused(lm, "items", query="q", items=["text", [1, 2]])


def vocab_size(path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def test_label_ids_outside_the_vocabulary_name_its_size(lm, tiny_qwen3_lm):
    vocab = vocab_size(tiny_qwen3_lm)
    error = refused(lm, "label_token_ids", query="q", items=["d"], label_token_ids=[5, vocab + 10])
    assert str(vocab) in error.reason


def test_more_than_128_label_ids_are_refused(lm):
    error = refused(lm, "label_token_ids", query="q", items=["d"], label_token_ids=list(range(129)))
    assert "128" in error.reason


def test_labels_must_be_single_tokens(lm):
    error = refused(lm, "labels", query="q", items=["d"], labels=["yes please", "no"])
    assert "'yes please'" in error.reason and "single token" in error.reason


def test_duplicate_labels_are_refused(lm):
    refused(lm, "labels", query="q", items=["d"], labels=["yes", "yes"])


def test_token_id_items_need_the_raw_template(lm):
    refused(lm, "items", query="q", items=[[5, 6], [7]])
    refused(lm, "query", query=[5, 6], items=["d"], template="qwen3-reranker")


def test_token_ids_outside_the_vocabulary_are_refused_before_the_model_sees_them(lm, tiny_qwen3_lm):
    vocab = vocab_size(tiny_qwen3_lm)
    refused(lm, "items[1]", query="q", items=[[5], [vocab]], label_token_ids=[5])
    refused(lm, "query", query=[vocab + 1], items=[[5]], label_token_ids=[5])


def test_mode_the_model_cannot_serve_is_refused(lm, embedder, cross_encoder, tiny_bert_embedder):
    error = refused(embedder, "mode", query="q", items=["d"], mode="generative")
    assert "bi-encoder" in error.reason
    refused(cross_encoder, "mode", query="q", items=["d"], mode="bi-encoder")
    refused(lm, "mode", query="q", items=["d"], mode="cross-encoder")
    refused(lm, "mode", query="q", items=["d"], mode="reranking")
    with pytest.raises(ModelLoadError):
        EmbeddedBackend(str(tiny_bert_embedder), device="cpu", mode="generative")


def test_fields_that_the_mode_would_ignore_are_refused(lm, embedder, cross_encoder):
    refused(cross_encoder, "labels", query="q", items=["d"], labels=["yes"])
    refused(embedder, "label_token_ids", query="q", items=["d"], label_token_ids=[1])
    refused(embedder, "return_label_logprobs", query="q", items=["d"], return_label_logprobs=True)
    refused(embedder, "template", query="q", items=["d"], template="qwen3-reranker")
    refused(lm, "item_first", query="q", items=["d"], item_first=True)
    refused(lm, "instruction", query="q", items=["d"], label_token_ids=[5], instruction="judge")
    refused(cross_encoder, "instruction", query="q", items=["d"], instruction="judge")
    refused(lm, "template", query="q", items=["d"], template="no-such-template")


def test_a_generative_model_without_a_known_template_asks_for_one(tmp_path_factory):
    from tiny_models import make_qwen3_causal_lm

    plain = make_qwen3_causal_lm(tmp_path_factory.mktemp("models"), name="plain-lm")
    error = refused(EmbeddedBackend(str(plain), device="cpu"), "template", query="q", items=["d"])
    assert "label_token_ids" in error.reason


def test_prefix_and_suffix_leaving_no_room_name_the_model_limit(lm):
    error = refused(lm, "query", query="fox " * 2100, items=["d"])
    assert "2048" in error.reason


def test_truncation_none_refuses_an_item_over_the_limit(lm):
    error = refused(lm, "items[1]", query="q", items=["dog", "fox " * 50], max_tokens_per_item=8, truncation="none")
    assert "the limit is 8" in error.reason


def test_missing_path_and_unknown_architecture_fail_to_load(tmp_path):
    with pytest.raises(ModelLoadError, match="no model folder"):
        EmbeddedBackend(str(tmp_path / "absent"), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert",
                                                      "architectures": ["BertForTokenClassification"]}))
    with pytest.raises(ModelLoadError, match="BertForTokenClassification"):
        EmbeddedBackend(str(tmp_path), device="cpu")


def test_a_device_this_process_lacks_is_refused_naming_the_device(tiny_qwen3_lm):
    unusable = ["gpu", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in unusable:
        with pytest.raises(InvalidRequest) as caught:
            EmbeddedBackend(str(tiny_qwen3_lm), device=device)
        assert caught.value.field == "device", caught.value


def test_backend_options_are_checked_before_the_model_loads(tmp_path):
    absent = str(tmp_path / "absent")  # loading it would raise ModelLoadError
    for options, field in (({"max_batch_tokens": 0}, "max_batch_tokens"), ({"template": "nope"}, "template")):
        with pytest.raises(InvalidRequest) as caught:
            EmbeddedBackend(absent, device="cpu", **options)
        assert caught.value.field == field, caught.value
