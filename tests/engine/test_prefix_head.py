"""The prefix's head (system prompt and instruction) is tokenized once per instruction, and the ids stay exact.

``encode._head_ids`` keeps the head's ids only where tokenizing head and tail apart gives the whole prefix's ids;
these tests compare every prefix with the tokenizer's own call on the whole text, for the byte-level BPE and the
WordPiece tokenizers, over instructions and queries whose edges touch the split (punctuation, spaces, line breaks,
special-token text), and check the fallback where a merge spans the split.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rerankit.engine import encode
from rerankit.engine.encode import encode_request
from rerankit.engine.load import load_model
from rerankit.schema import ScoreRequest
from rerankit.templates import get_template

EDGES = ["", ".", "!", " ", "  ", "\n", "\n\n", " \n", ":", "<|im_end|>", "é", "yes", "0"]
PIECES = ["judge", "the", "Document", "query", "dog", "Paris", "1234", "?", ",", " ", "\n", "<Query>", "é"]


def texts(rng: random.Random, count: int) -> list[str]:
    """Texts that begin and end with each edge (and random words between)."""
    out = []
    for _ in range(count):
        middle = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 8)))
        out.append(rng.choice(EDGES) + middle + rng.choice(EDGES))
    return out


@pytest.fixture(scope="module", params=["bpe", "wordpiece"])
def loaded(request, tiny_qwen3_lm, tiny_bert_cross_encoder):
    path = tiny_qwen3_lm if request.param == "bpe" else tiny_bert_cross_encoder
    return load_model(str(path), device="cpu")


@pytest.mark.parametrize("template_name", ["qwen3-reranker", "mxbai-rerank-v2", "bge-reranker-gemma"])
def test_prefix_ids_equal_the_whole_prefix_tokenized(loaded, template_name):
    template = get_template(template_name)
    rng = random.Random(template_name)
    tokenizer = loaded.tokenizer
    instructions = [None, *texts(rng, 12), "Find docs.", "Find docs ", "Find docs\n"]
    for instruction in instructions:
        for query in ["what is it?", *(text + "x" for text in texts(rng, 5))]:  # a query is never blank
            request = ScoreRequest(query=query, items=["a dog"], template=template_name, instruction=instruction)
            encoded = encode_request(request, loaded, "generative" if loaded.is_decoder else "cross-encoder",
                                     template)
            whole = tokenizer(template.prefix(instruction, query), add_special_tokens=False)["input_ids"]
            parts = encode._template_ids(tokenizer, template, instruction)
            assert encoded.prefix_ids == parts.bos + whole + parts.separator, (instruction, query)


def test_a_known_head_is_not_tokenized_again(tiny_qwen3_lm, monkeypatch):
    loaded = load_model(str(tiny_qwen3_lm), device="cpu")
    template = get_template("qwen3-reranker")
    instruction = "judge the Document " * 100
    first = ScoreRequest(query="what is it?", items=["a dog", "Paris"], template="qwen3-reranker",
                         instruction=instruction)
    encode_request(first, loaded, "generative", template)
    assert encode._head_ids(loaded.tokenizer, template, instruction, "x") is not None
    calls: list[list[str]] = []
    tokenize = encode._tokenize
    monkeypatch.setattr(encode, "_tokenize", lambda tok, batch: (calls.append(batch), tokenize(tok, batch))[1])
    second = first.model_copy(update={"query": "where is Paris?"})
    encoded = encode_request(second, loaded, "generative", template)
    assert calls == [["\n<Query>: where is Paris?\n", *map(template.item, second.items)]]
    whole = loaded.tokenizer(template.prefix(instruction, second.query), add_special_tokens=False)["input_ids"]
    assert encoded.prefix_ids == whole


QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


@pytest.fixture(scope="module")
def merging_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2's pre-tokenizer (its regex keeps line breaks with the punctuation before them) and a byte-level BPE
    whose vocabulary has a token for ".\n": a head that ends in "." merges with the tail's line break."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["docs.\n<Query>: a\n judge the Document!\n\n"] * 50, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_head_whose_last_token_merges_across_the_split_is_not_kept(merging_tokenizer):
    template = get_template("qwen3-reranker")
    head, tail = template.prefix_parts("docs.", "a")
    assert ids(merging_tokenizer, head + tail) != ids(merging_tokenizer, head) + ids(merging_tokenizer, tail)
    assert encode._head_ids(merging_tokenizer, template, "docs.", "a") is None
    assert encode._head_ids(merging_tokenizer, template, "docs", "a") is not None


def test_a_kept_head_gives_the_whole_prefix_ids_for_any_query(merging_tokenizer):
    """Checked on one query, the head holds for every other: the text between it and the query is the template's."""
    rng = random.Random(0)
    for template_name in ("qwen3-reranker", "mxbai-rerank-v2"):
        template = get_template(template_name)
        for instruction in texts(rng, 30):
            first, *others = [text + "x" for text in texts(rng, 6)]
            head_ids = encode._head_ids(merging_tokenizer, template, instruction, first)
            if head_ids is None:
                continue
            for query in others:
                tail = template.prefix_parts(instruction, query)[1]
                assert head_ids + ids(merging_tokenizer, tail) == ids(merging_tokenizer,
                                                                       template.prefix(instruction, query))
