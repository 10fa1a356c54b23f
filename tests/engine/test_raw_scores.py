"""``raw_scores``: the scores before their activation, against transformers' own logits in float32 (cross-encoders
of one and of two classes) and against the label log-probs (generative); bi-encoder scores stay as they are."""

from __future__ import annotations

import math

import pytest
import torch

from rerankit.engine import EmbeddedBackend
from rerankit.schema import ScoreRequest

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the dog sat on the mat", "berlin is in germany", "france"]


def transformers_logits(folder, documents=DOCS) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).float().eval()
    with torch.no_grad():
        batch = tokenizer([QUERY] * len(documents), documents, return_tensors="pt", padding=True)
        return model(**batch).logits.float()


def test_a_one_logit_cross_encoder_gives_its_logit(ce, tiny_bert_cross_encoder):
    raw = ce.score(ScoreRequest(query=QUERY, items=DOCS, raw_scores=True)).scores
    default = ce.score(ScoreRequest(query=QUERY, items=DOCS)).scores
    assert raw == pytest.approx(transformers_logits(tiny_bert_cross_encoder)[:, 0].tolist(), abs=1e-5)
    assert [1 / (1 + math.exp(-value)) for value in raw] == pytest.approx(default, abs=1e-6)


def test_a_two_class_cross_encoder_gives_class_ones_log_odds(tmp_path):
    from tiny_models import make_bert_cross_encoder

    folder = make_bert_cross_encoder(tmp_path, num_labels=2)
    logits = transformers_logits(folder)
    backend = EmbeddedBackend(str(folder), device="cpu")
    raw = backend.score(ScoreRequest(query=QUERY, items=DOCS, raw_scores=True)).scores
    backend.close()
    assert raw == pytest.approx((logits[:, 1] - logits[:, 0]).tolist(), abs=1e-5)


@pytest.mark.parametrize("multi_item", [True, False])
def test_a_generative_reranker_gives_the_positive_labels_log_odds(lm, label_ids, multi_item):
    asked = dict(query=QUERY, items=DOCS, label_token_ids=label_ids, multi_item=multi_item)
    raw = lm.score(ScoreRequest(**asked, raw_scores=True)).scores
    default = lm.score(ScoreRequest(**asked, return_label_logprobs=True))
    log_odds = [result.label_logprobs[0] - result.label_logprobs[1] for result in default.results]
    assert raw == pytest.approx(log_odds, abs=1e-5)
    assert [1 / (1 + math.exp(-value)) for value in raw] == pytest.approx(default.scores, abs=1e-6)


def test_a_lone_label_gives_the_logit_its_sigmoid_scores(lm, label_ids):
    asked = dict(query=QUERY, items=DOCS, label_token_ids=label_ids[:1])
    raw = lm.score(ScoreRequest(**asked, raw_scores=True)).scores
    default = lm.score(ScoreRequest(**asked)).scores
    assert [1 / (1 + math.exp(-value)) for value in raw] == pytest.approx(default, abs=1e-6)


def test_a_bi_encoder_has_no_activation_to_remove(tiny_bert_embedder):
    backend = EmbeddedBackend(str(tiny_bert_embedder), device="cpu")
    raw = backend.score(ScoreRequest(query=QUERY, items=DOCS, raw_scores=True)).scores
    default = backend.score(ScoreRequest(query=QUERY, items=DOCS)).scores
    backend.close()
    assert raw == pytest.approx(default, abs=1e-7)


def test_raw_and_activated_requests_in_one_call_each_get_theirs(ce):
    raw, default = ce.score_batch([ScoreRequest(query=QUERY, items=DOCS, raw_scores=True),
                                   ScoreRequest(query=QUERY, items=DOCS)])
    assert [1 / (1 + math.exp(-value)) for value in raw.scores] == pytest.approx(default.scores, abs=1e-6)
    assert any(value < 0 or value > 1 for value in raw.scores)


def test_windows_of_a_long_document_keep_the_max_of_their_raw_scores(ce):
    long_doc = " ".join(["paris france capital city"] * 60)
    asked = dict(query=QUERY, items=[long_doc, "france"], long_documents="max", long_document_window=32)
    raw = ce.score(ScoreRequest(**asked, raw_scores=True))
    default = ce.score(ScoreRequest(**asked))
    assert raw.results[0].windows > 1
    assert [1 / (1 + math.exp(-value)) for value in raw.scores] == pytest.approx(default.scores, abs=1e-6)
