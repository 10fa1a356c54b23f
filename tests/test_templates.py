"""Templates render the families' reference prompts and are detected from the model's name and architecture."""

from types import SimpleNamespace

import pytest

from rerankit.errors import InvalidRequest
from rerankit.templates import TEMPLATES, detect_template, get_template

QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
)
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
BGE_PROMPT = ("Given a query A and a passage B, determine whether the passage contains an answer to the query by "
              "providing a prediction of either 'Yes' or 'No'.")
MXBAI_TASK = ("You are a search relevance expert who evaluates how well documents match search queries. For each "
              "query-document pair, carefully analyze the semantic relationship between them, then provide your "
              "binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:")
MXBAI_CHAT_PREFIX = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                     "<|im_end|>\n<|im_start|>user\n")


def test_qwen3_reranker_renders_the_model_card_prompt():
    template = get_template("qwen3-reranker")
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    card = f"<Instruct>: {instruction}\n<Query>: What is the capital of China?\n<Document>: Beijing."
    assert template.render("What is the capital of China?", "Beijing.") == QWEN3_PREFIX + card + QWEN3_SUFFIX
    assert template.labels == ("yes", "no")
    assert template.default_instruction == instruction


def test_qwen3_reranker_takes_a_custom_instruction():
    prompt = get_template("qwen3-reranker").render("q", "d", instruction="Find code")
    assert "<Instruct>: Find code\n<Query>: q\n<Document>: d" in prompt


def test_bge_reranker_gemma_renders_flagembedding_layout():
    template = get_template("bge-reranker-gemma")
    assert template.render("what is panda?", "hi") == f"A: what is panda?\nB: hi\n{BGE_PROMPT}"
    assert template.render("q", "d", instruction="Judge it.") == "A: q\nB: d\nJudge it."
    assert template.labels == ("Yes",) and template.add_bos and template.separator == "\n"


def test_mxbai_rerank_v2_renders_mixedbread_layout_with_optional_instruction():
    template = get_template("mxbai-rerank-v2")
    chat_suffix = "<|im_end|>\n<|im_start|>assistant\n"
    assert template.render("q?", "d.") == f"{MXBAI_CHAT_PREFIX}query: q?\ndocument: d.\n{MXBAI_TASK}{chat_suffix}"
    with_instruction = template.render("q?", "d.", instruction="Be strict")
    assert with_instruction.startswith(f"{MXBAI_CHAT_PREFIX}instruction: Be strict\nquery: q?\n")
    assert template.labels == ("1", "0")


def test_raw_template_is_the_only_one_that_takes_token_ids():
    assert not get_template("raw").needs_text
    assert all(template.needs_text for name, template in TEMPLATES.items() if name != "raw")


@pytest.mark.parametrize("name, architecture, expected", [
    ("Qwen/Qwen3-Reranker-0.6B", "Qwen3ForCausalLM", "qwen3-reranker"),
    ("/models/qwen3-reranker-8b", "Qwen3ForCausalLM", "qwen3-reranker"),
    ("tomaarsen/Qwen3-Reranker-0.6B-seq-cls", "Qwen3ForSequenceClassification", "qwen3-reranker"),
    ("BAAI/bge-reranker-v2-gemma", "GemmaForCausalLM", "bge-reranker-gemma"),
    ("mixedbread-ai/mxbai-rerank-base-v2", "Qwen2ForCausalLM", "mxbai-rerank-v2"),
    ("mixedbread-ai/mxbai-rerank-base-v1", "DebertaV2ForSequenceClassification", None),
    ("Qwen/Qwen3-0.6B", "Qwen3ForCausalLM", None),
    ("cross-encoder/ms-marco-MiniLM-L6-v2", "BertForSequenceClassification", None),
])
def test_detect_template_from_name_and_architecture(name, architecture, expected):
    config = SimpleNamespace(architectures=[architecture], _name_or_path="")
    detected = detect_template(config, name)
    assert (detected.name if detected else None) == expected


def test_detect_template_reads_the_config_name_when_the_path_says_nothing():
    config = SimpleNamespace(architectures=["Qwen3ForCausalLM"], _name_or_path="Qwen/Qwen3-Reranker-4B")
    assert detect_template(config, "/srv/model").name == "qwen3-reranker"


def test_unknown_template_names_the_known_ones():
    with pytest.raises(InvalidRequest) as caught:
        get_template("llama-reranker")
    assert caught.value.field == "template" and "qwen3-reranker" in caught.value.reason


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("instruction", [None, "Find {x} docs.\n", ""])
def test_prefix_parts_split_the_prefix_before_the_query_line(name, instruction):
    template = TEMPLATES[name]
    query = "what {is} it?"
    head, tail = template.prefix_parts(instruction, query)
    assert head + tail == template.prefix(instruction, query)
    assert query not in head and head == template.prefix_parts(instruction, "other")[0]
    assert head == "" or tail.startswith("\n")


# --- user templates ---------------------------------------------------------------------------------------------

MINE = {"name": "mine-test", "prefix_format": "Question: {query}\n", "item_format": "Passage: {doc}",
        "suffix_format": "\nRelevant?", "labels": ["yes", "no"]}


@pytest.mark.parametrize("change, field, says", [
    ({"prefix_format": "Q: {question}"}, "template.prefix_format", "{question}"),
    ({"prefix_format": "no query here"}, "template.prefix_format", "{query}"),
    ({"item_format": "{doc} {query}"}, "template.item_format", "{query}"),
    ({"suffix_format": "a lone { brace"}, "template.suffix_format", "literal braces"),
    ({"labels": "yes"}, "template.labels", "list of non-empty strings"),
    ({"labels": ["yes", "yes"]}, "template.labels", "twice"),
    ({"name": " "}, "template.name", "non-empty"),
    ({"separator": 3}, "template.separator", "string"),
    ({"labels": 5}, "template.labels", "list of non-empty strings"),
    ({"add_bos": "false"}, "template.add_bos", "true or false"),
])
def test_a_bad_template_names_the_piece_and_why(change, field, says):
    from rerankit.templates import Template

    with pytest.raises(InvalidRequest) as error:
        Template(**{**MINE, **change})
    assert error.value.field == field and says in error.value.reason


def test_a_request_takes_a_template_by_its_pieces_with_typed_errors():
    from rerankit.schema import ScoreRequest
    from rerankit.templates import Template

    request = ScoreRequest(query="q", items=["d"], template=MINE)
    assert isinstance(request.template, Template) and request.template.labels == ("yes", "no")
    with pytest.raises(InvalidRequest) as error:
        ScoreRequest(query="q", items=["d"], template={**MINE, "prompt": "x"})
    assert error.value.field == "template.prompt"
    with pytest.raises(InvalidRequest) as error:
        ScoreRequest(query="q", items=["d"], template={"name": "x"})
    assert error.value.field == "template.prefix_format" and "missing" in error.value.reason


def test_registered_template_is_listed_detected_and_scores_as_its_pieces(monkeypatch, tiny_qwen3_lm):
    from types import SimpleNamespace

    from rerankit import templates
    from rerankit.engine import EmbeddedBackend
    from rerankit.schema import ScoreRequest
    from rerankit.templates import Template, register_template

    monkeypatch.setattr(templates, "TEMPLATES", dict(templates.TEMPLATES))
    monkeypatch.setattr(templates, "_DETECTION_RULES", list(templates._DETECTION_RULES))
    mine = register_template(Template(**MINE), matches=("my-reranker", "Qwen3"))
    assert templates.get_template("mine-test") is mine and templates.template_matches("mine-test") == [
        "my-reranker (Qwen3*)"]
    config = SimpleNamespace(architectures=["Qwen3ForCausalLM"], _name_or_path="")
    assert detect_template(config, "org/my-reranker-1b") is mine
    with pytest.raises(InvalidRequest) as error:
        register_template(Template(**MINE))
    assert "replace=True" in error.value.reason
    backend = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu")
    documents = ["Paris is the capital of France.", "Bananas are yellow."]
    by_name = backend.score(ScoreRequest(query="capital of France?", items=documents, template="mine-test"))
    by_pieces = backend.score(ScoreRequest(query="capital of France?", items=documents, template=MINE))
    default = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", template=mine)
    assert by_name.scores == by_pieces.scores == default.score(
        ScoreRequest(query="capital of France?", items=documents)).scores
    # the template has no {instruction}: an instruction given with it would not be written, so it is refused
    assert not mine.takes_instruction and get_template("qwen3-reranker").takes_instruction
    with pytest.raises(InvalidRequest, match="no {instruction} placeholder") as error:
        EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", template=mine, instruction="dropped")
    assert error.value.field == "instruction"
    with pytest.raises(InvalidRequest, match="no {instruction} placeholder") as error:
        backend.score(ScoreRequest(query="q", items=documents, template="mine-test", instruction="dropped"))
    assert error.value.field == "instruction"
    # a backend's default instruction goes only to templates that write it
    instructed = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", instruction="Find the capital")
    assert instructed.score(ScoreRequest(query="capital of France?", items=documents, template="mine-test")).scores \
        == by_name.scores
    assert by_name.scores != backend.score(ScoreRequest(query="capital of France?", items=documents)).scores
