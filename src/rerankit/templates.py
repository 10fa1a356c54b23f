"""Prompt templates and label words per model family, as data.

A scored sequence is ``[bos] prefix(instruction, query) sep item(doc) sep suffix(instruction)``: each of the
pieces is tokenized on its own (the prefix once per request, each item once, the suffix once) and the ids are
concatenated, the way the families' reference code builds its inputs. The label is read after the suffix.

``raw`` is vLLM's /generative_scoring and SGLang's /v1/score layout: query ids (with special tokens) then item
ids (without), or the other way round under ``item_first``, scored with the caller's label token ids.
This module imports nothing heavy: the remote client and the server use it too.
"""

from __future__ import annotations

import json
import string
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from rerankit.errors import InvalidRequest


@dataclass(frozen=True)
class Template:
    """How one model family wants a (query, document) pair written, and which tokens it answers with.

    ``{instruction}``, ``{query}`` and ``{doc}`` are the placeholders. ``instruction_format`` wraps a given
    instruction before it enters ``prefix_format``/``suffix_format``; no instruction renders as "".
    ``separator`` is tokenized alone and put between prefix and item and between item and suffix (the ``sep``
    of FlagEmbedding and mxbai). ``add_bos`` prepends the tokenizer's BOS token when it has a distinct one.
    ``lone_label_sigmoid``: with a single label, labels-only normalisation compares its logit with an implicit
    zero logit, i.e. sigmoid(logit) (FlagEmbedding's normalised score); raw mode keeps vLLM's softmax, which
    gives 1.0.
    """

    name: str
    prefix_format: str
    item_format: str
    suffix_format: str
    labels: tuple[str, ...]
    default_instruction: str | None = None
    instruction_format: str = "{instruction}"
    separator: str = ""
    add_bos: bool = False
    lone_label_sigmoid: bool = True

    def __post_init__(self) -> None:
        # A bad template fails here, naming its piece, instead of as a KeyError deep in the first request.
        if not isinstance(self.name, str) or not self.name.strip():
            raise InvalidRequest("template.name", "must be a non-empty string")
        for piece, allowed, required in _PIECES:
            _check_format(piece, getattr(self, piece), allowed, required)
        if not isinstance(self.separator, str):  # joined as is, never formatted: braces are literal
            raise InvalidRequest("template.separator", f"must be a string, got {type(self.separator).__name__}")
        for flag in ("add_bos", "lone_label_sigmoid"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidRequest(f"template.{flag}", f"must be true or false, got {getattr(self, flag)!r}")
        if not isinstance(self.labels, (list, tuple)) or not all(isinstance(label, str) and label
                                                                 for label in self.labels):
            booleans = isinstance(self.labels, (list, tuple)) and any(isinstance(label, bool) for label in self.labels)
            hint = "; YAML reads unquoted yes/no as booleans: quote them" if booleans else ""
            raise InvalidRequest("template.labels", f"must be a list of non-empty strings, got {self.labels!r}{hint}")
        object.__setattr__(self, "labels", tuple(self.labels))  # lists from JSON/YAML: keep the template hashable
        if len(set(self.labels)) != len(self.labels):
            raise InvalidRequest("template.labels", f"holds the same label twice ({list(self.labels)})")

    @property
    def needs_text(self) -> bool:
        """True when the query and the items must be texts (every template but ``raw``)."""
        return self.name != RAW

    @property
    def takes_instruction(self) -> bool:
        """True when the prefix or the suffix holds ``{instruction}``: else an instruction would not be written."""
        return any("instruction" in _placeholders(piece) for piece in (self.prefix_format, self.suffix_format))

    def _instruction(self, instruction: str | None) -> str:
        chosen = instruction if instruction is not None else self.default_instruction
        return self.instruction_format.format(instruction=chosen) if chosen else ""

    def prefix(self, instruction: str | None, query: str) -> str:
        """The text before the item: system prompt, instruction and query."""
        return self.prefix_format.format(instruction=self._instruction(instruction), query=query)

    def prefix_parts(self, instruction: str | None, query: str) -> tuple[str, str]:
        """The prefix as ``(head, tail)``, ``head + tail == prefix(...)``: the head is the text before the last line
        break ahead of the query, so it holds no query text and is the same for every query under one instruction;
        the tail is the rest, that line break on. The head is "" where no line break comes before the query."""
        before, marker, after = self.prefix_format.partition("{query}")
        chosen = self._instruction(instruction)
        if not marker:
            return "", self.prefix(instruction, query)
        rendered = before.format(instruction=chosen)
        cut = rendered.rfind("\n")
        if cut <= 0:
            return "", self.prefix(instruction, query)
        return rendered[:cut], rendered[cut:] + query + after.format(instruction=chosen)

    def item(self, doc: str) -> str:
        """The text of one item."""
        return self.item_format.format(doc=doc)

    def suffix(self, instruction: str | None = None) -> str:
        """The text after the item, up to where the label is read."""
        return self.suffix_format.format(instruction=self._instruction(instruction))

    def render(self, query: str, doc: str, instruction: str | None = None) -> str:
        """The whole prompt as one string (for remote servers and for reading; no BOS)."""
        return self.separator.join((self.prefix(instruction, query), self.item(doc), self.suffix(instruction)))


# (piece, the placeholders it may hold, the one it must hold)
_PIECES: tuple[tuple[str, frozenset[str], str | None], ...] = (
    ("prefix_format", frozenset({"instruction", "query"}), "query"),
    ("item_format", frozenset({"doc"}), "doc"),
    ("suffix_format", frozenset({"instruction"}), None),
    ("instruction_format", frozenset({"instruction"}), None),
)


def _check_format(piece: str, text: Any, allowed: frozenset[str], required: str | None) -> None:
    """``InvalidRequest`` naming ``template.<piece>`` when it is not a format string of the ``allowed`` placeholders."""
    field = f"template.{piece}"
    if not isinstance(text, str):
        raise InvalidRequest(field, f"must be a string, got {type(text).__name__}")
    try:
        names = _placeholders(text)
    except ValueError as exc:  # a lone "{" or "}": literal braces are written "{{" and "}}"
        raise InvalidRequest(field, f"is not a format string ({exc}); write literal braces as {{{{ and }}}}") from None
    unknown = names - allowed
    if unknown:
        known = ", ".join(f"{{{name}}}" for name in sorted(allowed)) or "none"
        raise InvalidRequest(field, f"has the placeholder(s) {', '.join(f'{{{n}}}' for n in sorted(unknown))}; "
                                    f"it may hold {known}")
    if required is not None and required not in names:
        raise InvalidRequest(field, f"must hold the placeholder {{{required}}}")


def _placeholders(text: str) -> set[str]:
    """The placeholder names of a format string (``ValueError`` for a lone brace)."""
    return {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}


RAW = "raw"

QWEN3_RERANKER = Template(
    name="qwen3-reranker",
    prefix_format=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
        "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
        "<Instruct>: {instruction}\n<Query>: {query}\n"
    ),
    item_format="<Document>: {doc}",
    suffix_format="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    labels=("yes", "no"),
    default_instruction="Given a web search query, retrieve relevant passages that answer the query",
)

# FlagEmbedding's BaseLLMReranker: [bos] "A: {query}" sep "B: {passage}" sep prompt; score is the "Yes" logit.
BGE_RERANKER_GEMMA = Template(
    name="bge-reranker-gemma",
    prefix_format="A: {query}",
    item_format="B: {doc}",
    suffix_format="{instruction}",
    labels=("Yes",),
    default_instruction=(
        "Given a query A and a passage B, determine whether the passage contains an answer to the query by "
        "providing a prediction of either 'Yes' or 'No'."
    ),
    separator="\n",
    add_bos=True,
)

# mixedbread-ai/mxbai-rerank MxbaiRerankV2: chat prefix, "query: ..." sep "document: ..." sep task prompt,
# chat suffix; the score is logit("1") - logit("0"), i.e. the softmax over ("1", "0").
MXBAI_RERANK_V2 = Template(
    name="mxbai-rerank-v2",
    prefix_format=(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n{instruction}query: {query}"
    ),
    item_format="document: {doc}",
    suffix_format=(
        "You are a search relevance expert who evaluates how well documents match search queries. For each "
        "query-document pair, carefully analyze the semantic relationship between them, then provide your "
        "binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    labels=("1", "0"),
    instruction_format="instruction: {instruction}\n",
    separator="\n",
)

RAW_TEMPLATE = Template(name=RAW, prefix_format="{query}", item_format="{doc}", suffix_format="", labels=(),
                        lone_label_sigmoid=False)

TEMPLATES: dict[str, Template] = {
    template.name: template for template in (QWEN3_RERANKER, BGE_RERANKER_GEMMA, MXBAI_RERANK_V2, RAW_TEMPLATE)
}

# (substring of the lower-cased model name, architecture prefix, template name): the first match wins; templates
# registered with ``matches`` come first, so a user's rule overrides a built-in one.
_DETECTION_RULES: list[tuple[str, str, str]] = [
    ("qwen3-reranker", "Qwen3", QWEN3_RERANKER.name),
    ("bge-reranker-v2-gemma", "Gemma", BGE_RERANKER_GEMMA.name),
    ("mxbai-rerank", "Qwen2", MXBAI_RERANK_V2.name),
]


def register_template(template: Template, *, matches: tuple[str, str] | None = None,
                      replace: bool = False) -> Template:
    """Add ``template`` to the registry under its name; ``matches=(name substring, architecture prefix)`` also
    picks it for models whose name and architecture match. Re-registering a name needs ``replace=True``."""
    if not isinstance(template, Template):
        raise InvalidRequest("template", f"must be a Template, got {type(template).__name__}")
    if template.name == RAW or (template.name in TEMPLATES and not replace):
        raise InvalidRequest("template.name", f"{template.name!r} is already registered"
                             + ("" if template.name == RAW else "; pass replace=True to replace it"))
    TEMPLATES[template.name] = template
    if matches is not None:
        pattern, architecture = matches
        _DETECTION_RULES.insert(0, (pattern.lower(), architecture, template.name))
    return template


def template_matches(name: str) -> list[str]:
    """The model families a template is detected for, as "name-substring (Architecture*)"."""
    return [f"{pattern} ({architecture}*)" for pattern, architecture, rule in _DETECTION_RULES if rule == name]


def get_template(name: "str | Template") -> Template:
    """The registered template called ``name`` (a ``Template`` is returned as is); ``InvalidRequest`` naming the
    known ones otherwise."""
    if isinstance(name, Template):
        return name
    try:
        return TEMPLATES[name]
    except KeyError:
        raise InvalidRequest("template", f"unknown template {name!r}; known: {', '.join(TEMPLATES)}") from None


def template_from_dict(data: Any, source: str = "template") -> Template:
    """A ``Template`` from its pieces (a JSON/YAML mapping); ``InvalidRequest`` naming a missing or unknown piece."""
    if not isinstance(data, dict):
        raise InvalidRequest(source, f"must be a mapping of template pieces, got {type(data).__name__}")
    known = [field.name for field in fields(Template)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise InvalidRequest(f"{source}.{unknown[0]}", f"is not a template piece; the pieces are {', '.join(known)}")
    required = [field.name for field in fields(Template)
                if field.default is MISSING and field.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise InvalidRequest(f"{source}.{missing[0]}", f"is missing (a template needs {', '.join(required[:-1])} "
                                                       f"and {required[-1]})")
    return Template(**data)


def load_template_file(path: str | Path) -> Template:
    """A template from a .json, .yaml or .yml file of its pieces (``template_from_dict``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest("--template-file", f"cannot read {path}: {exc}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml  # PyYAML (a huggingface_hub dependency) is imported only for YAML files

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InvalidRequest("--template-file", f"{path} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequest("--template-file", f"{path} is not valid JSON: {exc}") from None
    return template_from_dict(data, source=path.name)


def detect_template(config: Any, name: str) -> Template | None:
    """The template of a model, from its name (or ``config._name_or_path``) and its architecture; None if unknown."""
    architectures = tuple(getattr(config, "architectures", None) or ())
    names = (name.lower(), str(getattr(config, "_name_or_path", "") or "").lower())
    for pattern, architecture, template in _DETECTION_RULES:
        if any(pattern in candidate for candidate in names) and any(a.startswith(architecture) for a in architectures):
            return TEMPLATES[template]
    return None
