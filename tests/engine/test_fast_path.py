"""The packed runner (our forward, prefix sharing on) against the reference runner (transformers, padded).

Tiny models with weights spread wide enough (initializer_range 0.1, BERT 0.2) that their scores differ by more than the
ranking margin, so a swapped or misplaced item shows. Tokenizers are built here, so the GPU tests need no
packaged model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rerankit.engine import EmbeddedBackend
from rerankit.errors import InvalidRequest, ModelLoadError
from rerankit.schema import ScoreRequest
from test_reference_engine import DOCS as REFERENCE_DOCS
from test_reference_engine import QUERY
from tiny_models import build_decoder_tokenizer

DOCS = [*REFERENCE_DOCS, "Beijing", "China capital", "dog fox"]
MARGIN = 0.05  # rankings must agree wherever the reference scores differ by more than this
WIDE_INIT = 0.1
BERT_INIT = 0.2  # post-LayerNorm blocks pull the states together; wider weights keep the scores apart


def make_decoder(folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny Qwen3 causal LM ("lm") or one-logit sequence classifier ("cls") with the chat tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    tokenizer = build_decoder_tokenizer(folder)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=WIDE_INIT, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model_class = Qwen3ForCausalLM if kind == "lm" else Qwen3ForSequenceClassification
    model_class(config).eval().save_pretrained(folder)
    return folder


def make_bert(folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny BERT cross-encoder ("cross-encoder") or mean-pooling embedder ("embedder") with a WordPiece tokenizer
    over the words of the test texts."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = sorted({word for text in [QUERY, *DOCS] for word in re.findall(r"\w+|[^\w\s]", text.lower())})
    vocab = {token: index for index, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    tokenizer.save_pretrained(folder)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=512, num_labels=1,
                        initializer_range=BERT_INIT, architectures=["BertModel"] if kind == "embedder" else None)
    torch.manual_seed(seed)
    (BertModel if kind == "embedder" else BertForSequenceClassification)(config).eval().save_pretrained(folder)
    if kind == "embedder":
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
        (folder / "modules.json").write_text(
            '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},'
            ' {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]')
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fast-path")
    return {"lm": make_decoder(root / "qwen3-lm", "lm"), "qwen3-cls": make_decoder(root / "qwen3-cls", "cls", 1),
            "bert-ce": make_bert(root / "bert-ce", "cross-encoder"), "embedder": make_bert(root / "embed", "embedder")}


def label_ids(path: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer.convert_tokens_to_ids(["yes", "no"])


def request_for(case: str, path: Path, **options) -> ScoreRequest:
    if case == "template":
        return ScoreRequest(query=QUERY, items=DOCS, template="qwen3-reranker", **options)
    if case == "raw":
        return ScoreRequest(query=QUERY, items=DOCS, label_token_ids=label_ids(path), **options)
    if case in ("bi-encoder", "late-interaction"):
        return ScoreRequest(query=QUERY, items=DOCS, mode=case, **options)
    return ScoreRequest(query=QUERY, items=DOCS, **options)


CASES = {  # case -> model
    "template": "lm",
    "raw": "lm",
    "qwen3-cross-encoder": "qwen3-cls",
    "bert-cross-encoder": "bert-ce",
    "bi-encoder": "embedder",
    "late-interaction": "embedder",
}


def assert_same_ranking(scores: list[float], reference: list[float]) -> None:
    """Every pair of items whose reference scores differ by more than MARGIN is ordered the same way."""
    separated = [(i, j) for i in range(len(reference)) for j in range(len(reference))
                 if reference[i] - reference[j] > MARGIN]
    assert separated, f"no two reference scores differ by more than {MARGIN}: {reference}"
    swapped = [(i, j) for i, j in separated if not scores[i] > scores[j]]
    assert not swapped, f"items {swapped} swap order: {scores} vs reference {reference}"


@pytest.fixture(scope="module")
def backends(models):
    made: dict[tuple[str, str], EmbeddedBackend] = {}

    def get(model: str, runner: str, **options) -> EmbeddedBackend:
        key = (model, runner, tuple(sorted(options.items())))
        if key not in made:
            if runner == "packed":  # share prefixes on the CPU too, where it is exact but not the default
                options = {"multi_item": True, **options}
            made[key] = EmbeddedBackend(str(models[model]), runner=runner, **options)
        return made[key]

    return get


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("multi_item", [True, False])
def test_packed_runner_scores_equal_the_reference_runner(backends, models, case, multi_item):
    packed, reference = backends(CASES[case], "packed", device="cpu"), backends(CASES[case], "reference", device="cpu")
    assert (packed.runner, reference.runner) == ("packed", "reference")
    request = request_for(case, models[CASES[case]], multi_item=multi_item)
    fast, slow = packed.score(request), reference.score(request)
    torch.testing.assert_close(torch.tensor(fast.scores), torch.tensor(slow.scores), atol=1e-4, rtol=0)
    assert_same_ranking(fast.scores, slow.scores)
    assert fast.usage.prompt_tokens == slow.usage.prompt_tokens


@pytest.mark.parametrize("case", ["template", "raw"])
def test_label_logprobs_and_read_states_equal_the_reference(backends, models, case):
    request = request_for(case, models["lm"], return_label_logprobs=True, return_pooled_hidden_states=True,
                          apply_softmax=False)
    fast = backends("lm", "packed", device="cpu").score(request)
    slow = backends("lm", "reference", device="cpu").score(request)
    for name in ("label_logprobs", "pooled_hidden_state"):
        torch.testing.assert_close(torch.tensor([getattr(r, name) for r in fast.results]),
                                   torch.tensor([getattr(r, name) for r in slow.results]), atol=1e-4, rtol=0)


@pytest.mark.parametrize(("case", "pooling", "expected"), [
    ("template", None, "forward_read"), ("bert-cross-encoder", None, "forward_read"),
    ("bi-encoder", "mean", "forward"), ("late-interaction", "mean", "forward"),
])
def test_heads_that_read_one_token_run_only_the_read_rows(models, case, pooling, expected):
    backend = EmbeddedBackend(str(models[CASES[case]]), device="cpu", runner="packed")
    calls: list[str] = []
    runner = backend._runner
    for name in ("forward", "forward_read"):
        method = getattr(runner, name)
        setattr(runner, name, lambda batch, _method=method, _name=name: (calls.append(_name), _method(batch))[1])
    backend.score(request_for(case, models[CASES[case]]))
    item_calls = calls[1:] if case in ("bi-encoder", "late-interaction") else calls  # first: the query's forward
    assert item_calls and set(item_calls) == {expected}


def test_auto_runner_falls_back_to_the_reference_for_other_architectures(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_decoder_tokenizer(tmp_path / "gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "gpt2")
    assert EmbeddedBackend(str(tmp_path / "gpt2"), device="cpu").runner == "reference"
    with pytest.raises(ModelLoadError, match="no packed forward"):
        EmbeddedBackend(str(tmp_path / "gpt2"), device="cpu", runner="packed")
    with pytest.raises(InvalidRequest, match="runner"):
        EmbeddedBackend(str(tmp_path / "gpt2"), device="cpu", runner="fast")


def test_an_encoder_whose_tensors_do_not_build_the_packed_model_loads_with_transformers(
        monkeypatch, caplog, tiny_bert_embedder):
    from rerankit.engine import runner as runner_module

    build = runner_module.build_packed_model

    def from_modules_only(model):  # as a checkpoint whose tensor names the packed encoder does not read
        if not isinstance(model, torch.nn.Module):
            raise AttributeError("'types.SimpleNamespace' object has no attribute 'encoder'")
        return build(model)

    request = ScoreRequest(query=QUERY, items=REFERENCE_DOCS)
    expected = EmbeddedBackend(str(tiny_bert_embedder), device="cpu", runner="reference").score(request).scores
    monkeypatch.setattr(runner_module, "build_packed_model", from_modules_only)
    backend = EmbeddedBackend(str(tiny_bert_embedder), device="cpu")
    assert backend.runner == "packed" and isinstance(backend._model().model, torch.nn.Module)
    assert "loading the transformers model" in caplog.text
    assert backend.score(request).scores == pytest.approx(expected, abs=1e-5)


@pytest.mark.gpu
def test_auto_runner_keeps_head_sizes_the_cuda_kernel_cannot_tile_on_the_reference(tmp_path):
    from transformers import BertForSequenceClassification

    folder = make_bert(tmp_path / "bert-d8", "cross-encoder")
    model = BertForSequenceClassification.from_pretrained(folder)
    model.config.num_attention_heads = 8  # head size 64 / 8 = 8: below tl.dot's 16
    model.save_pretrained(folder)
    assert EmbeddedBackend(str(folder), device="cuda").runner == "reference"
    with pytest.raises(ModelLoadError, match="power of two"):
        EmbeddedBackend(str(folder), device="cuda", runner="packed")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["template", "raw", "qwen3-cross-encoder", "bert-cross-encoder", "bi-encoder"])
def test_gpu_bfloat16_packed_scores_follow_the_float32_reference(backends, models, case):
    fast_backend = backends(CASES[case], "auto", device="cuda")
    assert fast_backend.runner == "packed"
    request = request_for(case, models[CASES[case]])
    fast = fast_backend.score(request)
    slow = backends(CASES[case], "reference", device="cuda", dtype="float32").score(request)
    torch.testing.assert_close(torch.tensor(fast.scores), torch.tensor(slow.scores), atol=2e-2, rtol=0)
    assert_same_ranking(fast.scores, slow.scores)


@pytest.mark.parametrize("model", ["lm", "bert-ce", "embedder"])
def test_warm_up_scores_two_synthetic_requests_and_changes_no_score(models, model, monkeypatch):
    """``warm_up`` (what ``rerankit serve`` runs before it answers) scores 1 and 20 items in the model's default
    mode, through raw label ids when the model has no known template, and leaves later scores as they were."""
    backend = EmbeddedBackend(str(models[model]))
    request = request_for("raw" if model == "lm" else "plain", models[model])
    before = backend.score(request).scores
    scored: list[ScoreRequest] = []
    original = backend.score
    monkeypatch.setattr(backend, "score", lambda request: scored.append(request) or original(request))
    assert backend.warm_up() >= 0
    succeeded = [request for request in scored if request.label_token_ids is not None or model != "lm"]
    assert [len(request.items) for request in succeeded] == [1, 20]
    assert original(request).scores == before
