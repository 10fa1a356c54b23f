"""Packed forward of BERT-style encoders (BERT, RoBERTa, XLM-RoBERTa) and their classification heads.

Attention is bidirectional within each packed sequence (``batch.causal`` is False). Blocks are
post-LayerNorm: x = LN(x + attn(x)); x = LN(x + ffn(x)). Weights are the transformers model's own
tensors; q/k/v are fused once at load time (see ``fuse_rows``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rerankit.engine.batch import PackedBatch
from rerankit.engine.models.layers import (
    GELU_APPROXIMATIONS,
    PackedBody,
    default_attention,
    fuse_rows,
    layer_steps,
)
from rerankit.engine.prefix_cache import CachedKV
from rerankit.errors import ModelLoadError

MODEL_TYPES = ("bert", "roberta", "xlm-roberta")

AttentionFn = Callable[..., torch.Tensor]


def unsupported_reason(config) -> str | None:
    """Why the packed encoder cannot run this config, or None when it can."""
    if config.model_type not in MODEL_TYPES:
        return f"model_type {config.model_type!r}"
    if config.hidden_act not in GELU_APPROXIMATIONS:
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"position_embedding_type {config.position_embedding_type!r}"
    if getattr(config, "is_decoder", False):
        return "BERT used as a decoder"
    if getattr(config, "quantization_config", None) is not None:
        return "quantized weights"
    return None


def attention_inputs(hidden: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor, num_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused q/k/v projection, split into heads [T, H, D]."""
    q, k, v = F.linear(hidden, qkv_weight, qkv_bias).view(-1, 3, num_heads, head_dim).unbind(1)
    return q, k, v


def attention_output_and_ffn(attention: torch.Tensor, hidden: torch.Tensor, o_weight: torch.Tensor,
                             o_bias: torch.Tensor, attention_norm_weight: torch.Tensor,
                             attention_norm_bias: torch.Tensor, up_weight: torch.Tensor, up_bias: torch.Tensor,
                             down_weight: torch.Tensor, down_bias: torch.Tensor, output_norm_weight: torch.Tensor,
                             output_norm_bias: torch.Tensor, eps: float, approximate: str) -> torch.Tensor:
    """The rest of one block: output projection, residual, LayerNorm, GELU feed-forward, residual, LayerNorm."""
    size = hidden.shape[-1:]
    hidden = F.layer_norm(F.linear(attention.flatten(1), o_weight, o_bias) + hidden, size,
                          attention_norm_weight, attention_norm_bias, eps)
    inner = F.gelu(F.linear(hidden, up_weight, up_bias), approximate=approximate)
    return F.layer_norm(F.linear(inner, down_weight, down_bias) + hidden, size,
                        output_norm_weight, output_norm_bias, eps)


class PackedEncoderLayer(nn.Module):
    """One encoder block's weights, shared with (or fused from) a transformers ``BertLayer``-shaped layer."""

    def __init__(self, hf_layer: nn.Module) -> None:
        super().__init__()
        attn, attn_out = hf_layer.attention.self, hf_layer.attention.output
        self.qkv_weight = nn.Parameter(fuse_rows([attn.query.weight, attn.key.weight, attn.value.weight]),
                                       requires_grad=False)
        self.qkv_bias = nn.Parameter(fuse_rows([attn.query.bias, attn.key.bias, attn.value.bias]),
                                     requires_grad=False)
        self.o_weight, self.o_bias = attn_out.dense.weight, attn_out.dense.bias
        self.attention_norm_weight, self.attention_norm_bias = attn_out.LayerNorm.weight, attn_out.LayerNorm.bias
        self.up_weight, self.up_bias = hf_layer.intermediate.dense.weight, hf_layer.intermediate.dense.bias
        self.down_weight, self.down_bias = hf_layer.output.dense.weight, hf_layer.output.dense.bias
        self.output_norm_weight, self.output_norm_bias = hf_layer.output.LayerNorm.weight, hf_layer.output.LayerNorm.bias


class PackedEncoder(PackedBody):
    """Padding-free forward of a BERT/XLM-R body over a ``PackedBatch``, plus its sequence-classification head.

    ``batch.position_ids`` count from 0 in each sequence; RoBERTa-family models get their padding_idx+1
    offset added here. ``compile`` and ``attention_fn`` work as for ``PackedDecoder``.

    ``fp8``: the q/k/v, o, up and down weights are quantized to float8_e4m3fn per output channel (or taken as they
    are from ``fp8_weights``, an FP8 checkpoint's, by transformers module name) and each block runs
    ``engine.models.encoder_fp8``'s steps: activations quantized per token before each FP8 GEMM, the rest in bf16.
    ``fp8_steps`` is then the GEMM and the activation those steps call: cuBLAS's and the Triton kernel's on CUDA,
    their float32 references elsewhere or with $RERANKIT_FP8_REFERENCE=1.
    """

    def __init__(self, hf_model: nn.Module, compile: bool | None = None,
                 attention_fn: AttentionFn | None = None, fp8: bool = False,
                 fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        super().__init__()
        config = hf_model.config
        reason = unsupported_reason(config)
        if reason is not None:
            raise ModelLoadError(f"PackedEncoder does not support this model: {reason}")
        body = hf_model.base_model
        embeddings = body.embeddings
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.eps = config.layer_norm_eps
        self.scale = self.head_dim ** -0.5
        self.approximate = GELU_APPROXIMATIONS[config.hidden_act]
        self.position_offset = config.pad_token_id + 1 if config.model_type != "bert" else 0
        self.word_embeddings = embeddings.word_embeddings.weight
        self.position_embeddings = embeddings.position_embeddings.weight
        self.token_type_embeddings = embeddings.token_type_embeddings.weight
        self.embedding_norm_weight, self.embedding_norm_bias = embeddings.LayerNorm.weight, embeddings.LayerNorm.bias
        self.layers = nn.ModuleList(PackedEncoderLayer(layer) for layer in body.encoder.layer)
        pooler, classifier = _head(hf_model)
        self.pooler_weight, self.pooler_bias = (None, None) if pooler is None else (pooler.weight, pooler.bias)
        self.classifier_weight, self.classifier_bias = ((None, None) if classifier is None
                                                        else (classifier.weight, classifier.bias))
        self._attention_fn = attention_fn
        steps = (attention_inputs, attention_output_and_ffn)
        self.fp8_steps: tuple | None = None
        if fp8:
            from rerankit.engine.fp8 import per_channel, reference_mode
            from rerankit.engine.models import encoder_fp8

            stored = fp8_weights or {}
            named = hf_model.named_modules() if isinstance(hf_model, nn.Module) else ()
            with torch.no_grad():  # the stored weights, per channel, by the transformers module they belong to
                given = {id(module): per_channel(*stored[name]) for name, module in named if name in stored}
            for layer, hf_layer in zip(self.layers, body.encoder.layer):
                encoder_fp8.quantize_layer(layer, hf_layer, given)
            on_gpu = self.word_embeddings.device.type == "cuda" and not reference_mode()
            self.fp8_steps = encoder_fp8.GPU_STEPS if on_gpu else encoder_fp8.REFERENCE_STEPS
            steps = (encoder_fp8.attention_inputs, encoder_fp8.attention_output_and_ffn)
        self._attention_inputs, self._attention_output_and_ffn = layer_steps(
            *steps, compile=compile, device=self.word_embeddings.device)

    @torch.no_grad()
    def pool(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """tanh(dense(h)) on CLS states [N, hidden]: BERT's pooler, or the first half of XLM-R's head."""
        if self.pooler_weight is None:
            raise ModelLoadError(f"{type(self.config).__name__}: the loaded model has no pooler")
        return torch.tanh(F.linear(cls_hidden, self.pooler_weight, self.pooler_bias))

    @torch.no_grad()
    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """Sequence-classification logits [N, num_labels] from CLS (<s>) hidden states [N, hidden]."""
        if self.classifier_weight is None:
            raise ModelLoadError(f"{type(self.config).__name__}: the loaded model has no classification head")
        return F.linear(self.pool(cls_hidden), self.classifier_weight, self.classifier_bias)

    def _run(self, batch: PackedBatch, read_positions: torch.Tensor | None, graphed: bool,
             cached_kv: CachedKV | None = None) -> torch.Tensor:
        if cached_kv is not None:
            raise ValueError("a bidirectional encoder has no cached prefix keys")
        attention = self._attention_fn or default_attention()
        token_types = (batch.token_type_ids if batch.token_type_ids is not None
                       else torch.zeros_like(batch.input_ids))
        hidden = F.embedding(batch.input_ids, self.word_embeddings) + F.embedding(token_types,
                                                                                  self.token_type_embeddings)
        hidden = hidden + F.embedding(batch.position_ids + self.position_offset, self.position_embeddings)
        hidden = F.layer_norm(hidden, hidden.shape[-1:], self.embedding_norm_weight, self.embedding_norm_bias,
                              self.eps)
        last = len(self.layers) - 1
        fp8 = self.fp8_steps
        for index, layer in enumerate(self.layers):
            if fp8 is None:
                q, k, v = self._attention_inputs(hidden, layer.qkv_weight, layer.qkv_bias, self.num_heads,
                                                 self.head_dim)
            else:
                q, k, v = self._attention_inputs(hidden, layer.qkv_weight, layer.qkv_scale, layer.qkv_bias,
                                                 self.num_heads, self.head_dim, fp8[0])
            attended = attention(q, k, v, batch, scale=self.scale)
            if index == last and read_positions is not None:
                # Past the last attention no token needs another, so only the read rows go on
                # (1.5% of the W1 forward on an H100, benchmarks/forward.py).
                attended, hidden = attended[read_positions], hidden[read_positions]
            if fp8 is None:
                hidden = self._attention_output_and_ffn(
                    attended, hidden, layer.o_weight, layer.o_bias, layer.attention_norm_weight,
                    layer.attention_norm_bias, layer.up_weight, layer.up_bias, layer.down_weight, layer.down_bias,
                    layer.output_norm_weight, layer.output_norm_bias, self.eps, self.approximate)
            else:
                hidden = self._attention_output_and_ffn(
                    attended, hidden, layer.o_weight, layer.o_scale, layer.o_bias, layer.attention_norm_weight,
                    layer.attention_norm_bias, layer.up_weight, layer.up_scale, layer.up_bias, layer.up_bound,
                    layer.down_weight, layer.down_scale, layer.down_bias, layer.output_norm_weight,
                    layer.output_norm_bias, self.eps, self.approximate, *fp8)
        return hidden


def _head(hf_model: nn.Module) -> tuple[nn.Linear | None, nn.Linear | None]:
    """(dense+tanh layer, final linear) of the model's classification head; either may be None.

    BERT: the body's pooler, then ``classifier``. XLM-R: ``classifier.dense`` then ``classifier.out_proj``;
    both compute out(tanh(dense(cls))) (dropout is off at inference).
    """
    head = getattr(hf_model, "classifier", None)
    if head is not None and hasattr(head, "out_proj"):
        return head.dense, head.out_proj
    pooler = getattr(hf_model.base_model, "pooler", None)
    pooler_dense = None if pooler is None else pooler.dense
    return pooler_dense, head if isinstance(head, nn.Linear) else None
