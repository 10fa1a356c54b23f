"""Heads: from final hidden states of a packed batch to one score per read position.

Most heads need the states at the read positions only (``Head.reads_only``), so the runner computes just those
rows in its last layer; mean pooling and late interaction need every token of a sequence. The generative head
never forms a ``[tokens x vocab]`` tensor: label log-probs come from the label-logprob kernel over the reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from rerankit.engine.batch import PackedBatch
from rerankit.errors import ModelLoadError
from rerankit.kernels.label_logprobs import label_logprobs


@dataclass
class BatchScores:
    """One row per read (one scored item), in the order of the states the head was given."""

    scores: torch.Tensor
    label_logprobs: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    raw: torch.Tensor | None = None  # the scores before their activation (``raw_scores``); None: the same


def logit_of_first(logprobs: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of the first column's probability, from log-probs ``[N, L]``: against the others' summed
    probability where there are others (exact for a softmax over them), else against the rest of the unit."""
    first = logprobs[:, 0]
    if logprobs.shape[1] > 1:
        return first - torch.logsumexp(logprobs[:, 1:], dim=-1)
    return first - torch.log(-torch.expm1(first))


@dataclass(frozen=True)
class Head:
    """``score(states, batch)``: with ``reads_only`` the states at the read positions ``[N, d]`` (in read order),
    otherwise every token's state ``[T, d]`` of ``batch``."""

    score: Callable[[torch.Tensor, PackedBatch], BatchScores]
    reads_only: bool


def reads_only(mode: str, pooling: str | None) -> bool:
    """Whether the head of ``mode`` needs the states at the read positions only; known before the head is built,
    so the planner can give the other heads' requests micro-batches of their own."""
    if mode in ("generative", "cross-encoder"):
        return True
    return mode == "bi-encoder" and pooling != "mean"


def generative_head(lm_head: torch.nn.Module, label_ids: list[int], *, apply_softmax: bool,
                    lone_label_sigmoid: bool) -> Head:
    """p(first label) at each read position: softmax over the labels, or the full-vocabulary probability.

    With ``lone_label_sigmoid`` and a single label under ``apply_softmax``, the score is sigmoid(logit).
    """
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    label_tensor = torch.tensor(label_ids, device=weight.device)
    # The lone label's row, gathered once per head rather than once per micro-batch.
    lone_row = weight[label_tensor].float() if apply_softmax and lone_label_sigmoid else None
    lone_bias = bias[label_tensor].float() if lone_row is not None and bias is not None else None

    def score(read: torch.Tensor, batch: PackedBatch) -> BatchScores:
        if lone_row is not None:
            logits = read.float() @ lone_row.T
            if lone_bias is not None:
                logits = logits + lone_bias
            logprobs, raw = F.logsigmoid(logits), logits[:, 0]
        else:
            ids = label_tensor.expand(read.shape[0], -1)
            logprobs = label_logprobs(read, weight, ids, full_vocab=not apply_softmax, lm_head_bias=bias)
            raw = logit_of_first(logprobs) if apply_softmax else logit_of_first(logprobs[:, :1])
        return BatchScores(logprobs[:, 0].exp(), logprobs, read, raw)

    return Head(score, reads_only=True)


def sequence_classifier(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The classification head of a ``*ForSequenceClassification`` as a map from read states ``[N, d]`` to logits.

    Decoders (Qwen3, Llama, ...) apply ``score`` to the last token; BERT and DeBERTa pool the first token then
    classify; RoBERTa/XLM-R/ELECTRA heads read the first token themselves.
    """
    score = getattr(model, "score", None)
    if isinstance(score, torch.nn.Linear):
        return score
    classifier = getattr(model, "classifier", None)
    pooler = getattr(model, "pooler", None)
    if pooler is None:
        pooler = getattr(model.base_model, "pooler", None)
    if isinstance(classifier, torch.nn.Linear) and pooler is not None:
        return lambda read: classifier(pooler(read[:, None, :]))
    if classifier is not None and hasattr(classifier, "out_proj"):
        return lambda read: classifier(read[:, None, :])
    raise ModelLoadError(f"the classification head of {type(model).__name__} is not supported: rerankit reads "
                         "BERT/DeBERTa (pooler + classifier), RoBERTa-style and decoder (score) heads")


def cross_encoder_head(classify: Callable[[torch.Tensor], torch.Tensor]) -> Head:
    """Sigmoid of a single logit, or the softmax probability of class 1 when there are several; raw: that logit,
    or class 1's log-odds against the others."""

    def score(read: torch.Tensor, batch: PackedBatch) -> BatchScores:
        logits = classify(read).float()
        if logits.shape[1] == 1:
            return BatchScores(logits[:, 0].sigmoid(), pooled=read, raw=logits[:, 0])
        logprobs = logits.log_softmax(-1)
        class_one_first = [1, 0, *range(2, logits.shape[1])]
        return BatchScores(logprobs[:, 1].exp(), pooled=read, raw=logit_of_first(logprobs[:, class_one_first]))

    return Head(score, reads_only=True)


def pool(hidden: torch.Tensor, batch: PackedBatch, pooling: str, normalize: bool,
         at_reads: bool = False) -> torch.Tensor:
    """One embedding per sequence: mean over its tokens, or its first (cls) / last token.

    ``at_reads``: ``hidden`` already holds the states at the read positions (cls / last-token pooling only).
    """
    if at_reads:
        pooled = hidden.float()
    elif pooling == "mean":
        cu = batch.cu_seqlens.to(hidden.device, torch.int64)
        lengths = cu[1:] - cu[:-1]
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths)
        sums = torch.zeros(lengths.numel(), hidden.shape[1], device=hidden.device).index_add_(0, segment,
                                                                                                hidden.float())
        pooled = sums / lengths[:, None]
    else:
        pooled = hidden[batch.read_positions.to(hidden.device)].float()
    return F.normalize(pooled, dim=-1) if normalize else pooled


def bi_encoder_head(query_embedding: torch.Tensor, pooling: str, normalize: bool) -> Head:
    """Cosine similarity between the query's pooled embedding and each item's."""
    at_reads = reads_only("bi-encoder", pooling)

    def score(states: torch.Tensor, batch: PackedBatch) -> BatchScores:
        pooled = pool(states, batch, pooling, normalize, at_reads=at_reads)
        scores = F.cosine_similarity(pooled, query_embedding[None, :].to(pooled.device), dim=-1)
        return BatchScores(scores, pooled=pooled)

    return Head(score, reads_only=at_reads)


def late_interaction_head(query_tokens: torch.Tensor, pooling: str, normalize: bool) -> Head:
    """MaxSim: for each query token its best cosine over an item's tokens, summed over the query tokens."""
    query_unit = F.normalize(query_tokens.float(), dim=-1)

    def score(hidden: torch.Tensor, batch: PackedBatch) -> BatchScores:
        cu = batch.cu_seqlens.to(hidden.device, torch.int64)
        lengths = cu[1:] - cu[:-1]
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths)
        similarity = query_unit.to(hidden.device) @ F.normalize(hidden.float(), dim=-1).T  # [q, T]
        best = torch.full((similarity.shape[0], lengths.numel()), float("-inf"), device=hidden.device)
        best = best.scatter_reduce(1, segment.expand_as(similarity), similarity, reduce="amax")
        return BatchScores(best.sum(0), pooled=pool(hidden, batch, pooling, normalize))

    return Head(score, reads_only=reads_only("late-interaction", pooling))
