"""Strict pydantic models of the peers' wire formats, field by field from /work/shared/WIRE.md.

Written apart from ``rerankit.remote.dialects`` on purpose: they are the test oracle. Client tests validate
the request bodies rerankit sends; server tests validate the response and error bodies rerankit serves.
Unknown fields are refused (``extra="forbid"``) and types are strict (no "1" for 1, no true for 1).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

TokenIds = list[int]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# vLLM 0.33 ---------------------------------------------------------------------------------------------

class VllmMultiModal(Strict):
    content: list[dict[str, Any]]


class VllmGenerativeScoringRequest(Strict):
    """POST /generative_scoring."""

    model: str | None = None
    query: Union[str, TokenIds]
    items: Union[list[str], list[TokenIds]]
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None


class VllmPoolingCommon(Strict):
    """The fields /score and /rerank share."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None
    priority: int = 0
    request_id: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    padding: Any = None


ScoreSide = Union[str, list[str], VllmMultiModal, None]


class VllmScoreRequest(VllmPoolingCommon):
    """POST /score: exactly one of the pairs queries+documents, queries+items, data_1+data_2, text_1+text_2."""

    queries: ScoreSide = None
    documents: ScoreSide = None
    items: ScoreSide = None
    data_1: ScoreSide = None
    data_2: ScoreSide = None
    text_1: ScoreSide = None
    text_2: ScoreSide = None

    @model_validator(mode="after")
    def _one_pair(self) -> "VllmScoreRequest":
        given = {name for name in ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2")
                 if getattr(self, name) is not None}
        pairs = [{"queries", "documents"}, {"queries", "items"}, {"data_1", "data_2"}, {"text_1", "text_2"}]
        if given not in pairs:
            raise ValueError(f"needs exactly one field pair, got {sorted(given)}")
        return self


class VllmRerankRequest(VllmPoolingCommon):
    """POST /rerank, /v1/rerank, /v2/rerank."""

    query: Union[str, VllmMultiModal]
    documents: Union[str, list[str], VllmMultiModal]
    top_n: int = Field(default=0, ge=0)


class VllmScoreData(Strict):
    index: int
    object: Literal["score"]
    score: float


class VllmUsage(Strict):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = None


class VllmScoreResponse(Strict):
    """Response of /generative_scoring and /score."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[VllmScoreData]
    usage: VllmUsage


class VllmRerankDocument(Strict):
    text: str


class VllmRerankResult(Strict):
    index: int
    document: VllmRerankDocument
    relevance_score: float


class VllmRerankResponse(Strict):
    id: str
    model: str
    usage: VllmUsage
    results: list[VllmRerankResult]


class VllmErrorInfo(Strict):
    message: str
    type: str
    param: str | None
    code: int


class VllmError(Strict):
    error: VllmErrorInfo


# SGLang 0.5.23 -----------------------------------------------------------------------------------------

class SglangScoreRequest(Strict):
    """POST /v1/score."""

    query: Union[str, TokenIds]
    items: Union[str, list[str], list[TokenIds]]
    label_token_ids: Union[list[int], list[list[int]], None] = None
    apply_softmax: bool = False
    temperature: float = Field(default=1.0, gt=0)
    return_token_logprobs: bool = False
    item_first: bool = False
    return_pooled_hidden_states: bool = False
    score_extraction_token: str | None = None
    embed_override_token_id: int | None = None
    query_embed_overrides: Any = None
    item_embed_overrides: Any = None
    model: str | None = None


class SglangScoreResponse(Strict):
    scores: list[list[float]]
    pooled_hidden_states: list[list[float]] | None
    token_logprobs: Any
    model: str
    usage: dict[str, Any] | None
    object: Literal["scoring"]


class SglangRerankRequest(Strict):
    """POST /v1/rerank."""

    query: Union[str, list[dict[str, Any]]]
    documents: list[Union[str, dict[str, Any]]]
    instruct: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class SglangRerankResult(Strict):
    score: float
    index: int
    document: str | None = None
    meta_info: dict[str, Any] | None = None


class SglangRerankResponse(RootModel[list[SglangRerankResult]]):
    """A JSON list, sorted by score."""


class SglangError(Strict):
    object: Literal["error"]
    message: str
    type: str
    param: str | None
    code: int


# Cohere-style /v2/rerank (and Jina/Infinity /v1/rerank) -------------------------------------------------

class CohereRerankRequest(Strict):
    """Cohere v2, plus what the v1 API and Jina add (object documents, rank_fields, chunks, return_documents)."""

    model: str | None = None
    query: str
    documents: list[Union[str, dict[str, Any]]]
    top_n: int | None = None
    max_tokens_per_doc: int | None = None
    return_documents: bool | None = None
    rank_fields: list[str] | None = None
    max_chunks_per_doc: int | None = None
    priority: int | None = None


class CohereDocument(Strict):
    text: str


class CohereRerankResult(Strict):
    index: int
    relevance_score: float
    document: CohereDocument | None = None


class CohereRerankResponse(Strict):
    id: str
    results: list[CohereRerankResult]
    meta: dict[str, Any]


class CohereError(Strict):
    message: str


# Jina AI /v1/rerank ------------------------------------------------------------------------------------

class JinaRerankRequest(Strict):
    model: str
    query: str
    documents: list[Union[str, dict[str, Any]]]
    top_n: int | None = None
    return_documents: bool | None = None


class JinaUsage(Strict):
    total_tokens: int


class JinaRerankResponse(Strict):
    """Jina's reply (``model``, ``usage``, ``results``) within Cohere v1's (``id``, ``meta``): a Cohere v1 client
    without the SDK sends the same body."""

    id: str
    model: str
    usage: JinaUsage
    results: list[CohereRerankResult]
    meta: dict[str, Any]


class JinaError(Strict):
    detail: str


# text-embeddings-inference /rerank ----------------------------------------------------------------------

class TeiRerankRequest(Strict):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Literal["Right", "Left"] = "Right"


class TeiRank(Strict):
    index: int
    score: float
    text: str | None = None


class TeiRerankResponse(RootModel[list[TeiRank]]):
    """A JSON list, sorted by score."""


class TeiError(Strict):
    error: str
    error_type: str


# Infinity /rerank (infinity_client 0.0.78 RerankInput / ReRankResult) --------------------------------------

class InfinityRerankRequest(Strict):
    query: str
    documents: list[str]
    return_documents: bool = False
    raw_scores: bool = False
    model: str = "default/not-specified"
    top_n: int | None = None


class InfinityRerankResult(Strict):
    relevance_score: float
    index: int
    document: str | None = None


class InfinityRerankResponse(Strict):
    object: Literal["rerank"] = "rerank"
    results: list[InfinityRerankResult]
    model: str
    usage: VllmUsage
    id: str | None = None
    created: int | None = None


# NVIDIA NIM /v1/ranking (what langchain-nvidia-ai-endpoints 1.5 and llama-index-postprocessor-nvidia-rerank 0.7
# send and read) ---------------------------------------------------------------------------------------------

class NimText(Strict):
    text: str


class NimRankingRequest(Strict):
    model: str | None = None
    query: NimText
    passages: list[NimText]
    truncate: Literal["NONE", "END"] | None = None


class NimRanking(Strict):
    index: int
    logit: float


class NimRankingResponse(Strict):
    rankings: list[NimRanking]


# Voyage AI /v1/rerank (the voyageai SDK 0.5: what Client.rerank sends, and what its RerankingObject reads) --------

class VoyageRerankRequest(Strict):
    query: str
    documents: list[str]
    model: str
    top_k: int | None = None
    truncation: bool = True
    return_documents: bool = False


class VoyageRerankResult(Strict):
    relevance_score: float
    index: int
    document: str | None = None


class VoyageUsage(Strict):
    total_tokens: int


class VoyageRerankResponse(Strict):
    object: Literal["list"]
    data: list[VoyageRerankResult]
    model: str
    usage: VoyageUsage


class VoyageError(Strict):
    detail: str


# By rerankit dialect name ------------------------------------------------------------------------------

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "vllm-generative": VllmGenerativeScoringRequest, "vllm-score": VllmScoreRequest,
    "vllm-rerank": VllmRerankRequest, "sglang-score": SglangScoreRequest, "sglang-rerank": SglangRerankRequest,
    "cohere": CohereRerankRequest, "jina": JinaRerankRequest, "tei": TeiRerankRequest,
    "infinity": InfinityRerankRequest, "nim": NimRankingRequest, "voyage": VoyageRerankRequest,
}
RESPONSE_MODELS: dict[str, type[BaseModel]] = {
    "vllm-generative": VllmScoreResponse, "vllm-score": VllmScoreResponse, "vllm-rerank": VllmRerankResponse,
    "sglang-score": SglangScoreResponse, "sglang-rerank": SglangRerankResponse, "cohere": CohereRerankResponse,
    "jina": JinaRerankResponse, "tei": TeiRerankResponse, "infinity": InfinityRerankResponse,
    "nim": NimRankingResponse, "voyage": VoyageRerankResponse,
}
ERROR_MODELS: dict[str, type[BaseModel]] = {
    "vllm-generative": VllmError, "vllm-score": VllmError, "vllm-rerank": VllmError, "sglang-score": SglangError,
    "sglang-rerank": SglangError, "cohere": CohereError, "jina": JinaError, "tei": TeiError, "infinity": VllmError,
    "nim": VllmError,  # NIM documents no error body of its own: rerankit's (vLLM's shape)
    "voyage": VoyageError,
}
# Wire responses whose results come sorted by score, best first.
SORTED_RESPONSES = frozenset({"vllm-rerank", "sglang-rerank", "cohere", "jina", "tei", "infinity", "nim", "voyage"})
