"""The reference engine against transformers computed directly, the way each family's own code does it."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rerankit.defaults import default_model_path
from rerankit.engine import EmbeddedBackend
from rerankit.engine.encode import encode_request
from rerankit.engine.resolve import resolve_template
from rerankit.engine.load import load_model
from rerankit.engine.plan import group_by_length
from rerankit.schema import ScoreRequest
from rerankit.templates import get_template

QUERY = "What is the capital of China?"
DOCS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other.",
    "Paris is the capital and most populous city of France!",
    "yes no Yes",
    "the quick brown fox jumps over the lazy dog",
]
QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
)
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def lm_backend(tiny_qwen3_lm):
    return EmbeddedBackend(str(tiny_qwen3_lm), device="cpu")


@pytest.fixture(scope="module")
def hf_lm(tiny_qwen3_lm):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_lm, dtype=torch.float32).eval()


def last_token_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    """Full-vocabulary logits after each sequence, one forward per sequence (no padding anywhere)."""
    with torch.no_grad():
        return torch.stack([model(torch.tensor([ids])).logits[0, -1].float() for ids in sequences])


def model_card_scores(path, query: str, docs: list[str], max_length: int = 8192) -> torch.Tensor:
    """Qwen3-Reranker's model-card code: formatted pairs, left padding, logits[:, -1], log_softmax([no, yes])."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    token_false_id = tokenizer.convert_tokens_to_ids("no")
    token_true_id = tokenizer.convert_tokens_to_ids("yes")
    prefix_tokens = tokenizer.encode(QWEN3_PREFIX, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(QWEN3_SUFFIX, add_special_tokens=False)
    pairs = [f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}" for doc in docs]
    inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                       max_length=max_length - len(prefix_tokens) - len(suffix_tokens))
    for index, ids in enumerate(inputs["input_ids"]):
        inputs["input_ids"][index] = prefix_tokens + ids + suffix_tokens
    inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=max_length)
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1, :]
    stacked = torch.stack([logits[:, token_false_id], logits[:, token_true_id]], dim=1)
    return torch.nn.functional.log_softmax(stacked, dim=1)[:, 1].exp()


@pytest.mark.filterwarnings("ignore:`max_length` is ignored")  # the model card's own tokenizer.pad call
def test_generative_scores_equal_the_qwen3_reranker_model_card(lm_backend, tiny_qwen3_lm):
    response = lm_backend.score(ScoreRequest(query=QUERY, items=DOCS))
    expected = model_card_scores(tiny_qwen3_lm, QUERY, DOCS)
    torch.testing.assert_close(torch.tensor(response.scores), expected, atol=1e-5, rtol=0)
    assert [result.index for result in response.results] == list(range(len(DOCS)))


def _qwen3_pair_ids(tokenizer, query: str, doc: str) -> list[int]:
    text = QWEN3_PREFIX + f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}" + QWEN3_SUFFIX
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_full_vocabulary_probabilities_and_label_logprobs(lm_backend, hf_lm, tiny_qwen3_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    logits = last_token_logits(hf_lm, [_qwen3_pair_ids(tokenizer, QUERY, doc) for doc in DOCS])
    full = logits.log_softmax(-1)[:, [yes, no]]
    response = lm_backend.score(ScoreRequest(query=QUERY, items=DOCS, apply_softmax=False,
                                             return_label_logprobs=True))
    torch.testing.assert_close(torch.tensor(response.scores), full[:, 0].exp(), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor([r.label_logprobs for r in response.results]), full, atol=1e-5, rtol=0)
    normalised = lm_backend.score(ScoreRequest(query=QUERY, items=DOCS, return_label_logprobs=True))
    torch.testing.assert_close(torch.tensor([r.label_logprobs for r in normalised.results]),
                               full.log_softmax(-1), atol=1e-5, rtol=0)


def test_pooled_hidden_state_is_the_final_state_at_the_read_position(lm_backend, hf_lm, tiny_qwen3_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    response = lm_backend.score(ScoreRequest(query=QUERY, items=DOCS[:2], return_pooled_hidden_states=True))
    for doc, result in zip(DOCS[:2], response.results):
        with torch.no_grad():
            hidden = hf_lm(torch.tensor([_qwen3_pair_ids(tokenizer, QUERY, doc)]),
                           output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(torch.tensor(result.pooled_hidden_state), hidden, atol=1e-5, rtol=0)


def vllm_generative_scores(model, tokenizer, query, items, label_ids, *, apply_softmax=True, item_first=False,
                           add_special_tokens=True) -> torch.Tensor:
    """vLLM /generative_scoring: query ids (special tokens as asked) + item ids (none); p(first label)."""
    query_ids = query if isinstance(query, list) else tokenizer.encode(query, add_special_tokens=add_special_tokens)
    prompts = []
    for item in items:
        item_ids = item if isinstance(item, list) else tokenizer.encode(item, add_special_tokens=False)
        prompts.append(item_ids + query_ids if item_first else query_ids + item_ids)
    logprobs = last_token_logits(model, prompts).log_softmax(-1)[:, label_ids]
    probabilities = logprobs.softmax(-1) if apply_softmax else logprobs.exp()
    return probabilities[:, 0]


@pytest.mark.parametrize("apply_softmax", [True, False])
@pytest.mark.parametrize("item_first", [False, True])
def test_raw_scores_equal_vllm_semantics(lm_backend, hf_lm, tiny_qwen3_lm, apply_softmax, item_first):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    label_ids = [tokenizer.convert_tokens_to_ids(word) for word in ("Yes", "No", "yes")]
    query = "<|im_start|>user\nIs this the capital of China? "
    items = ["Beijing <|im_start|>assistant\n", "Paris <|im_start|>assistant\n", "fox"]
    response = lm_backend.score(ScoreRequest(query=query, items=items, label_token_ids=label_ids,
                                             apply_softmax=apply_softmax, item_first=item_first))
    expected = vllm_generative_scores(hf_lm, tokenizer, query, items, label_ids, apply_softmax=apply_softmax,
                                      item_first=item_first)
    torch.testing.assert_close(torch.tensor(response.scores), expected, atol=1e-5, rtol=0)


def test_raw_scoring_takes_token_ids(lm_backend, hf_lm, tiny_qwen3_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    query_ids = tokenizer.encode("Is Beijing the capital?", add_special_tokens=False)
    item_ids = [tokenizer.encode(doc, add_special_tokens=False) for doc in DOCS[:3]]
    label_ids = [tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")]
    response = lm_backend.score(ScoreRequest(query=query_ids, items=item_ids, label_token_ids=label_ids))
    expected = vllm_generative_scores(hf_lm, tokenizer, query_ids, item_ids, label_ids)
    torch.testing.assert_close(torch.tensor(response.scores), expected, atol=1e-5, rtol=0)


def test_raw_single_label_softmax_is_one_as_in_vllm(lm_backend, tiny_qwen3_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    response = lm_backend.score(ScoreRequest(query="q", items=DOCS[:2],
                                             label_token_ids=[tokenizer.convert_tokens_to_ids("yes")]))
    assert response.scores == [1.0, 1.0]


def test_bge_reranker_gemma_template_scores_the_yes_logit_like_flagembedding(lm_backend, hf_lm, tiny_qwen3_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    prompt = get_template("bge-reranker-gemma").default_instruction

    def tokens(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    sequences = [[tokenizer.bos_token_id] + tokens(f"A: {QUERY}") + tokens("\n") + tokens(f"B: {doc}")
                 + tokens("\n") + tokens(prompt) for doc in DOCS]
    yes_logit = last_token_logits(hf_lm, sequences)[:, tokenizer("Yes", add_special_tokens=False)["input_ids"][0]]
    response = lm_backend.score(ScoreRequest(query=QUERY, items=DOCS, template="bge-reranker-gemma"))
    torch.testing.assert_close(torch.tensor(response.scores), yes_logit.sigmoid(), atol=1e-5, rtol=0)


def test_mxbai_rerank_v2_template_scores_like_mixedbread(lm_backend, hf_lm, tiny_qwen3_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    template = get_template("mxbai-rerank-v2")

    def tokens(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    chat_prefix, task_and_suffix = template.prefix(None, "").removesuffix("query: "), template.suffix()
    task, chat_suffix = task_and_suffix.split("<|im_end|>", 1)
    sequences = [tokens(chat_prefix) + tokens(f"query: {QUERY}") + tokens("\n") + tokens(f"document: {doc}")
                 + tokens("\n") + tokens(task) + tokens("<|im_end|>" + chat_suffix) for doc in DOCS]
    logits = last_token_logits(hf_lm, sequences)
    one, zero = (tokens(label)[0] for label in ("1", "0"))
    response = lm_backend.score(ScoreRequest(query=QUERY, items=DOCS, template="mxbai-rerank-v2"))
    torch.testing.assert_close(torch.tensor(response.scores), (logits[:, one] - logits[:, zero]).sigmoid(),
                               atol=1e-5, rtol=0)


def test_bert_cross_encoder_equals_transformers(tiny_bert_cross_encoder):
    backend = EmbeddedBackend(str(tiny_bert_cross_encoder), device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_cross_encoder)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert_cross_encoder).eval()
    with torch.no_grad():
        logits = model(**tokenizer([QUERY] * len(DOCS), DOCS, padding=True, truncation=True,
                                   return_tensors="pt")).logits
    response = backend.score(ScoreRequest(query=QUERY, items=DOCS))
    torch.testing.assert_close(torch.tensor(response.scores), logits[:, 0].sigmoid(), atol=1e-5, rtol=0)


def test_two_class_xlm_roberta_cross_encoder_scores_class_one(tmp_path, tiny_bert_cross_encoder):
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(5)
    config = XLMRobertaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=130, num_labels=2, pad_token_id=0)
    XLMRobertaForSequenceClassification(config).eval().save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_bert_cross_encoder).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        logits = model(**tokenizer([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")).logits
    response = EmbeddedBackend(str(tmp_path), device="cpu").score(ScoreRequest(query=QUERY, items=DOCS))
    torch.testing.assert_close(torch.tensor(response.scores), logits.softmax(-1)[:, 1], atol=1e-5, rtol=0)


def test_qwen3_sequence_classifier_reads_the_last_token(tiny_qwen3_classifier):
    backend = EmbeddedBackend(str(tiny_qwen3_classifier), device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_classifier)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_qwen3_classifier).eval()
    with torch.no_grad():
        plain = model(**tokenizer([QUERY] * len(DOCS), DOCS, padding=True, return_tensors="pt")).logits
        prompts = [get_template("qwen3-reranker").render(QUERY, doc) for doc in DOCS]
        templated = model(**tokenizer(prompts, padding=True, add_special_tokens=False, return_tensors="pt")).logits
    response = backend.score(ScoreRequest(query=QUERY, items=DOCS))
    torch.testing.assert_close(torch.tensor(response.scores), plain[:, 0].sigmoid(), atol=1e-5, rtol=0)
    response = backend.score(ScoreRequest(query=QUERY, items=DOCS, template="qwen3-reranker"))
    torch.testing.assert_close(torch.tensor(response.scores), templated[:, 0].sigmoid(), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def embedder(tiny_bert_embedder):
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_embedder)
    model = AutoModel.from_pretrained(tiny_bert_embedder).eval()

    def token_states(texts):
        with torch.no_grad():
            return [model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0] for text in texts]

    return EmbeddedBackend(str(tiny_bert_embedder), device="cpu"), token_states


def test_bi_encoder_cosine_of_mean_pooled_embeddings(embedder):
    backend, token_states = embedder
    query, *docs = (states.mean(0) for states in token_states([QUERY] + DOCS))
    expected = torch.stack([torch.cosine_similarity(query, doc, dim=0) for doc in docs])
    response = backend.score(ScoreRequest(query=QUERY, items=DOCS, return_pooled_hidden_states=True))
    torch.testing.assert_close(torch.tensor(response.scores), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(response.results[0].pooled_hidden_state), docs[0], atol=1e-5, rtol=0)
    assert response.usage.computed_tokens < response.usage.prompt_tokens  # the query is encoded once


def test_late_interaction_is_maxsim_over_normalised_token_embeddings(embedder):
    backend, token_states = embedder
    query, *docs = (torch.nn.functional.normalize(states, dim=-1) for states in token_states([QUERY] + DOCS))
    expected = torch.stack([(query @ doc.T).max(dim=1).values.sum() for doc in docs])
    response = backend.score(ScoreRequest(query=QUERY, items=DOCS, mode="late-interaction"))
    torch.testing.assert_close(torch.tensor(response.scores), expected, atol=1e-4, rtol=0)


def test_packaged_minilm_ranks_the_relevant_document_first():
    backend = EmbeddedBackend(default_model_path(), device="cpu")
    docs = ["Bananas are a yellow fruit rich in potassium.",
            "A car engine burns fuel to push pistons and turn the crankshaft.",
            "Paris is the capital and largest city of France, on the Seine.",
            "Banana bread is made from ripe mashed bananas."]
    paris = backend.score(ScoreRequest(query="What is the capital of France?", items=docs))
    assert [result.index for result in paris.ranked()][0] == 2
    fruit = backend.score(ScoreRequest(query="Which fruit is yellow and has potassium?", items=docs))
    assert [result.index for result in fruit.ranked(2)] == [0, 3]
    engine = backend.score(ScoreRequest(query="how do combustion engines work", items=docs))
    assert engine.ranked(1)[0].index == 1


def test_truncation_cuts_the_item_and_keeps_the_suffix(tiny_qwen3_lm):
    loaded = load_model(str(tiny_qwen3_lm), device="cpu")
    long_doc = "the quick brown fox jumps over the lazy dog " * 30
    for policy in ("end", "start"):
        request = ScoreRequest(query=QUERY, items=[long_doc, "dog"], max_tokens_per_item=12, truncation=policy)
        template = resolve_template(request, loaded, None, "generative")
        encoded = encode_request(request, loaded, "generative", template)
        document_tag = loaded.tokenizer("<Document>:", add_special_tokens=False)["input_ids"]
        sequence = encoded.prefix_ids + encoded.item_ids[0] + encoded.suffix_ids
        # max_tokens_per_item counts the document's tokens, not the template's "<Document>: " before them
        lead = _shared_lead(loaded.tokenizer, long_doc)
        assert len(encoded.item_ids[0]) == lead + 12 and encoded.item_ids[1] == loaded.tokenizer(
            "<Document>: dog", add_special_tokens=False)["input_ids"]
        assert sequence[-len(encoded.suffix_ids):] == encoded.suffix_ids
        assert encoded.item_ids[0][:len(document_tag)] == document_tag  # the template's lead survives either way
        words = loaded.tokenizer.decode(encoded.item_ids[0])
        document = words.removeprefix("<Document>:")
        assert len(loaded.tokenizer(document, add_special_tokens=False)["input_ids"]) <= 12 + 1
        assert long_doc.startswith(document.lstrip()) if policy == "end" else long_doc.endswith(document)


def _shared_lead(tokenizer, doc: str) -> int:
    """How many tokens of the Qwen3 item text are the template's ``<Document>: `` rather than the document's."""
    item = tokenizer(f"<Document>: {doc}", add_special_tokens=False)["input_ids"]
    tag = tokenizer("<Document>: ", add_special_tokens=False)["input_ids"]
    return next((n for n, (a, b) in enumerate(zip(item, tag)) if a != b), min(len(item), len(tag)))


def test_truncated_scores_equal_scoring_the_cut_text(lm_backend, tiny_qwen3_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    long_doc = "Gravity is a force that attracts two bodies towards each other. " * 10
    lead = _shared_lead(tokenizer, long_doc)
    cut_ids = tokenizer(f"<Document>: {long_doc}", add_special_tokens=False)["input_ids"][:lead + 20]
    cut_doc = tokenizer.decode(cut_ids).removeprefix("<Document>: ")
    truncated = lm_backend.score(ScoreRequest(query=QUERY, items=[long_doc], max_tokens_per_item=20))
    exact = lm_backend.score(ScoreRequest(query=QUERY, items=[cut_doc]))
    assert truncated.scores == pytest.approx(exact.scores, abs=1e-6)


def test_group_by_length_places_every_index_once_within_the_budget():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 80))]
        budget = rng.choice([1, 50, 400, 2000, 10**6])
        for padded in (True, False):
            groups = group_by_length(lengths, budget, padded=padded)
            assert sorted(index for group in groups for index in group) == list(range(len(lengths)))
            for group in groups:
                cost = max(lengths[i] for i in group) * len(group) if padded else sum(lengths[i] for i in group)
                assert cost <= budget or len(group) == 1


@pytest.mark.parametrize("multi_item", [False, True])
def test_no_item_is_lost_or_duplicated_for_any_batch_budget(tiny_qwen3_lm, multi_item):
    rng = random.Random(1)
    words = "the quick brown fox jumps over the lazy dog Paris capital France gravity".split()
    items = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(40)]
    request = ScoreRequest(query=QUERY, items=items, return_label_logprobs=True)
    runs = [EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", max_batch_tokens=budget,
                            multi_item=multi_item).score(request)
            for budget in (1, 300, 2000, 10**6)]
    one_by_one = torch.tensor(runs[0].scores)
    assert len(set(runs[0].scores)) == len(set(items))  # scores tell the items apart, so a swap would show
    for before, response in zip(runs, runs[1:]):
        torch.testing.assert_close(torch.tensor(response.scores), one_by_one, atol=1e-5, rtol=0)
        if multi_item:  # a larger budget repeats the shared prefix in fewer micro-batches
            assert response.usage.prompt_tokens == runs[0].usage.prompt_tokens
            assert response.usage.computed_tokens <= before.usage.computed_tokens
        else:
            assert response.usage == runs[0].usage
    assert (runs[-1].usage.computed_tokens < runs[0].usage.computed_tokens) == multi_item


def test_usage_counts_pair_tokens(lm_backend, tiny_qwen3_lm):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_lm)
    response = lm_backend.score(ScoreRequest(query=QUERY, items=DOCS, multi_item=False))
    expected = sum(len(_qwen3_pair_ids(tokenizer, QUERY, doc)) for doc in DOCS)
    assert response.usage.prompt_tokens == response.usage.computed_tokens == expected


def test_threads_and_asyncio_share_one_backend(lm_backend):
    request = ScoreRequest(query=QUERY, items=DOCS)
    expected = lm_backend.score(request).scores
    with ThreadPoolExecutor(4) as pool:
        for response in pool.map(lambda _: lm_backend.score(request), range(8)):
            assert response.scores == pytest.approx(expected, abs=1e-6)

    async def concurrently():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticking = asyncio.create_task(ticker())
        responses = await asyncio.gather(*(lm_backend.ascore(request) for _ in range(3)))
        ticking.cancel()
        return responses, ticks

    responses, ticks = asyncio.run(concurrently())
    assert ticks > 0 and all(r.scores == pytest.approx(expected, abs=1e-6) for r in responses)


def test_progress_bar_shows_for_large_calls_unless_turned_off(tiny_bert_embedder, capsys):
    items = [f"doc {i}" for i in range(300)]
    EmbeddedBackend(str(tiny_bert_embedder), device="cpu").score(ScoreRequest(query="doc", items=items))
    assert "300/300" in capsys.readouterr().err
    quiet = EmbeddedBackend(str(tiny_bert_embedder), device="cpu", show_progress=False)
    quiet.score(ScoreRequest(query="doc", items=items))
    EmbeddedBackend(str(tiny_bert_embedder), device="cpu").score(ScoreRequest(query="doc", items=items[:5]))
    assert "rerankit" not in capsys.readouterr().err


def test_closed_backend_refuses_work(tiny_bert_embedder):
    from rerankit.errors import ModelLoadError

    backend = EmbeddedBackend(str(tiny_bert_embedder), device="cpu")
    backend.close()
    with pytest.raises(ModelLoadError):
        backend.score(ScoreRequest(query="q", items=["d"]))


@pytest.mark.gpu
@pytest.mark.parametrize("apply_softmax", [True, False])
def test_gpu_bfloat16_scores_follow_cpu_float32(tiny_qwen3_lm, tiny_bert_cross_encoder, apply_softmax):
    generative = ScoreRequest(query=QUERY, items=DOCS, apply_softmax=apply_softmax, return_label_logprobs=True)
    pairs = ScoreRequest(query=QUERY, items=DOCS)
    for path, request in ((tiny_qwen3_lm, generative), (tiny_bert_cross_encoder, pairs)):
        gpu = EmbeddedBackend(str(path), device="cuda").score(request)
        cpu = EmbeddedBackend(str(path), device="cpu").score(request)
        torch.testing.assert_close(torch.tensor(gpu.scores), torch.tensor(cpu.scores), atol=2e-2, rtol=0)
