"""Encoding a request: one batched tokenizer call per request, template parts and head tokenized once, ids unchanged.

Run as a script to time W1's encoding (1 query x 100 docs of 64..448 single-token words, Qwen3-Reranker template,
the tiny BPE tokenizer), median of 20 calls:

    PYTHONPATH=src python tests/engine/test_encode_speed.py
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rerankit.engine import encode
from rerankit.engine.encode import encode_request
from rerankit.engine.resolve import resolve_template
from rerankit.engine.load import load_model
from rerankit.schema import ScoreRequest
from rerankit.templates import get_template

QUERY = "what is the capital of france and why is it famous"
TEXTS = ["The capital of China is Beijing.", "<|im_start|>user\nyes no Yes<|im_end|>\n", "", " \n\n", "dog fox",
         "Paris is the capital and most populous city of France! 0123456789"]


@pytest.fixture(scope="module")
def loaded(tiny_qwen3_lm):
    return load_model(str(tiny_qwen3_lm), device="cpu")


def w1_request(loaded, count: int = 100, seed: int = 0) -> ScoreRequest:
    """W1's shape: docs of 64..448 words that the tokenizer keeps as one token each after a space."""
    tokenizer = loaded.tokenizer
    words = sorted({word for token in tokenizer.get_vocab()
                    if (word := tokenizer.convert_tokens_to_string([token]).strip()).isalpha()
                    and len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1})
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(64, 448))) for _ in range(count)]
    return ScoreRequest(query=QUERY, items=docs, template="qwen3-reranker")


def test_backend_tokenization_equals_the_tokenizer_call(loaded):
    tokenizer = loaded.tokenizer
    assert encode._tokenize(tokenizer, TEXTS) == tokenizer(TEXTS, add_special_tokens=False)["input_ids"]
    assert encode._tokenize(tokenizer, []) == []


def test_backend_tokenization_follows_the_wrapper_settings(loaded):
    tokenizer = loaded.tokenizer
    backend = tokenizer.backend_tokenizer
    backend.enable_truncation(max_length=3)
    tokenizer.split_special_tokens = True
    try:
        ids = encode._tokenize(tokenizer, TEXTS)
        assert backend.truncation is None and max(map(len, ids)) > 3
        assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in ids[1]
        assert ids == tokenizer(TEXTS, add_special_tokens=False)["input_ids"]
    finally:
        tokenizer.split_special_tokens = False


def recorded_tokenize_calls(monkeypatch) -> list[list[str]]:
    """The texts of every ``encode._tokenize`` call from now on (it still tokenizes)."""
    calls: list[list[str]] = []
    tokenize = encode._tokenize
    monkeypatch.setattr(encode, "_tokenize",
                        lambda tokenizer, texts: (calls.append(texts), tokenize(tokenizer, texts))[1])
    return calls


def test_a_template_request_is_one_tokenizer_call_of_its_query_line_and_items(loaded, monkeypatch):
    request = w1_request(loaded, count=5)
    template = get_template("qwen3-reranker")
    encode_request(request, loaded, "generative", template)  # the template's parts and head, once per tokenizer
    calls = recorded_tokenize_calls(monkeypatch)
    encoded = encode_request(request, loaded, "generative", template)
    assert calls == [[template.prefix_parts(None, QUERY)[1], *map(template.item, request.items)]]
    tokenizer = loaded.tokenizer

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assert encoded.prefix_ids == ids(template.prefix(None, QUERY))
    assert encoded.suffix_ids == ids(template.suffix(None))
    assert encoded.item_ids == [ids(template.item(doc)) for doc in request.items]
    assert encoded.label_ids == [ids(label)[0] for label in template.labels]


def test_a_later_chunk_reuses_the_prefix_and_chunks_concatenate_to_the_whole(loaded, monkeypatch):
    request = w1_request(loaded, count=7).model_copy(update={"instruction": "judge it " * 50})
    template = get_template("qwen3-reranker")
    whole = encode_request(request, loaded, "generative", template)
    first = encode_request(request, loaded, "generative", template, slice(0, 3))
    calls = recorded_tokenize_calls(monkeypatch)
    rest = encode_request(request, loaded, "generative", template, slice(3, 7), first)
    assert calls == [list(map(template.item, request.items[3:]))]  # the instruction and query not again
    first.extend(rest)
    assert (first.prefix_ids, first.suffix_ids, first.item_ids) == (whole.prefix_ids, whole.suffix_ids,
                                                                     whole.item_ids)


def test_a_later_raw_chunk_takes_the_query_and_labels_from_the_earlier_one(loaded, monkeypatch):
    """Every encoder's later chunk: only its items are tokenized; the rest is the earlier chunk's encoding."""
    request = ScoreRequest(query=QUERY, items=["a dog", "the cat sat", "dogs", "a b c d"], label_token_ids=[5, 6],
                           max_tokens_per_item=2)
    raw = get_template("raw")
    whole = encode_request(request, loaded, "generative", raw)
    first = encode_request(request, loaded, "generative", raw, slice(0, 1))
    calls = recorded_tokenize_calls(monkeypatch)

    def no_query(*args, **kwargs):
        raise AssertionError("a later chunk tokenized the query again")

    monkeypatch.setattr(type(loaded.tokenizer), "__call__", no_query)
    rest = encode_request(request, loaded, "generative", raw, slice(1, 4), first)
    assert calls == [request.items[1:]]
    first.extend(rest)
    assert (first.prefix_ids, first.suffix_ids, first.item_ids, first.label_ids) == (
        whole.prefix_ids, whole.suffix_ids, whole.item_ids, whole.label_ids)


def test_an_instruction_gets_its_own_template_ids(loaded):
    template = get_template("qwen3-reranker")
    plain = encode_request(ScoreRequest(query=QUERY, items=["dog"], template="qwen3-reranker"), loaded,
                           "generative", template)
    instructed = encode_request(ScoreRequest(query=QUERY, items=["dog"], template="qwen3-reranker",
                                             instruction="Find dogs"), loaded, "generative", template)
    expected = loaded.tokenizer(template.prefix("Find dogs", QUERY), add_special_tokens=False)["input_ids"]
    assert instructed.prefix_ids == expected
    assert instructed.prefix_ids != plain.prefix_ids


def time_w1_encoding(repeats: int = 20) -> tuple[float, int]:
    """Median ms of ``encode_request`` on W1, and W1's tokens, with the tiny Qwen3 model's tokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import make_qwen3_causal_lm

    loaded = load_model(str(make_qwen3_causal_lm(Path(tempfile.mkdtemp()))), device="cpu")
    request = w1_request(loaded)
    template = resolve_template(request, loaded, None, "generative")
    encoded = encode_request(request, loaded, "generative", template)
    timings = []
    for _ in range(repeats):
        begun = time.perf_counter()
        encode_request(request, loaded, "generative", template)
        timings.append(time.perf_counter() - begun)
    return statistics.median(timings) * 1000, sum(encoded.pair_lengths)


if __name__ == "__main__":
    median, tokens = time_w1_encoding()
    print(f"encode_request W1 (100 docs, {tokens} tokens): median of 20 {median:.2f} ms")
