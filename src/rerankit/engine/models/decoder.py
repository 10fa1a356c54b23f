"""Packed forward of Llama-style decoders: Llama, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

The body runs over a ``PackedBatch``: tokens of many sequences end to end, no padding, attention
masked per sequence (and per MIS item span) by ``packed_attention``. Weights are the loaded
transformers model's own tensors; q/k/v and gate/up are fused once at load time (see ``fuse_rows``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rerankit.engine.batch import PackedBatch
from rerankit.engine.models.layers import (
    apply_rotary,
    default_attention,
    fuse_rows,
    layer_steps,
    rms_norm,
    rope_inverse_frequencies,
    rope_unsupported_reason,
    rotary_cos_sin,
    swiglu,
)
from rerankit.errors import ModelLoadError

MODEL_TYPES = ("llama", "qwen2", "qwen3")

AttentionFn = Callable[..., torch.Tensor]


def unsupported_reason(config) -> str | None:
    """Why the packed decoder cannot run this config, or None when it can."""
    if config.model_type not in MODEL_TYPES:
        return f"model_type {config.model_type!r}"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if getattr(config, "quantization_config", None) is not None:
        return "quantized weights"
    return rope_unsupported_reason(config)


def attention_inputs(hidden: torch.Tensor, input_norm: torch.Tensor, qkv_weight: torch.Tensor,
                     qkv_bias: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer up to attention: norm, fused q/k/v, optional per-head q/k norm, rotary. Heads [T, H, D]."""
    qkv = F.linear(rms_norm(hidden, input_norm, eps), qkv_weight, qkv_bias)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.view(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def attention_output_and_mlp(attention: torch.Tensor, hidden: torch.Tensor, o_weight: torch.Tensor,
                             o_bias: torch.Tensor | None, post_norm: torch.Tensor, gate_up_weight: torch.Tensor,
                             gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor,
                             down_bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The rest of one layer: output projection, residual, norm, SwiGLU MLP, residual."""
    hidden = hidden + F.linear(attention.flatten(1), o_weight, o_bias)
    return hidden + swiglu(rms_norm(hidden, post_norm, eps), gate_up_weight, gate_up_bias, down_weight, down_bias)


class PackedDecoderLayer(nn.Module):
    """One decoder layer's weights, shared with (or fused from) a transformers decoder layer."""

    def __init__(self, hf_layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.input_norm = hf_layer.input_layernorm.weight
        self.qkv_weight = nn.Parameter(fuse_rows([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                                       requires_grad=False)
        self.qkv_bias = _parameter(fuse_rows([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = None if q_norm is None else q_norm.weight
        self.k_norm = None if k_norm is None else k_norm.weight
        self.o_weight, self.o_bias = attn.o_proj.weight, attn.o_proj.bias
        self.post_norm = hf_layer.post_attention_layernorm.weight
        self.gate_up_weight = nn.Parameter(fuse_rows([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                           requires_grad=False)
        self.gate_up_bias = _parameter(fuse_rows([mlp.gate_proj.bias, mlp.up_proj.bias]))
        self.down_weight, self.down_bias = mlp.down_proj.weight, mlp.down_proj.bias


def _parameter(tensor: torch.Tensor | None) -> nn.Parameter | None:
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)


class PackedDecoder(nn.Module):
    """Padding-free forward of a Llama/Qwen2/Qwen3 body over a ``PackedBatch``.

    ``compile`` runs the per-layer math around attention through ``torch.compile`` (attention is the
    ``attention_fn``'s own business); None compiles on CUDA only, as measured in ``layer_steps``.
    ``attention_fn`` defaults to ``rerankit.engine.attention.packed_attention``.
    """

    def __init__(self, hf_model: nn.Module, compile: bool | None = None,
                 attention_fn: AttentionFn | None = None) -> None:
        super().__init__()
        config = hf_model.config
        reason = unsupported_reason(config)
        if reason is not None:
            raise ModelLoadError(f"PackedDecoder does not support this model: {reason}")
        body = hf_model.base_model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.embed_weight = body.embed_tokens.weight
        self.layers = nn.ModuleList(PackedDecoderLayer(layer) for layer in body.layers)
        self.norm_weight = body.norm.weight
        device = self.embed_weight.device
        self.register_buffer("inv_freq", rope_inverse_frequencies(config, self.head_dim).to(device), persistent=False)
        self.lm_head_weight = _lm_head_weight(hf_model, self.embed_weight)
        score = getattr(hf_model, "score", None)
        self.score_weight = score.weight if isinstance(score, nn.Linear) else None
        self._attention_fn = attention_fn
        self._attention_inputs, self._attention_output_and_mlp = layer_steps(
            attention_inputs, attention_output_and_mlp, compile=compile, device=device)

    @torch.no_grad()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every packed token."""
        return self._run(batch, read_positions=None)

    @torch.no_grad()
    def forward_read(self, batch: PackedBatch) -> torch.Tensor:
        """Final-normed hidden states [N, hidden] at ``batch.read_positions`` only."""
        return self._run(batch, read_positions=batch.read_positions)

    def _run(self, batch: PackedBatch, read_positions: torch.Tensor | None) -> torch.Tensor:
        attention = self._attention_fn or default_attention()
        hidden = F.embedding(batch.input_ids, self.embed_weight)
        cos, sin = rotary_cos_sin(batch.position_ids, self.inv_freq, hidden.dtype)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            q, k, v = self._attention_inputs(hidden, layer.input_norm, layer.qkv_weight, layer.qkv_bias,
                                             layer.q_norm, layer.k_norm, cos, sin, self.eps, self.num_heads,
                                             self.num_kv_heads, self.head_dim)
            attended = attention(q, k, v, batch, scale=self.scale)
            if index == last and read_positions is not None:
                # Past the last attention no token needs another, so only the read rows go on
                # (1.5% of the W1 forward on an H100, benchmarks/forward.py).
                attended, hidden = attended[read_positions], hidden[read_positions]
            hidden = self._attention_output_and_mlp(attended, hidden, layer.o_weight, layer.o_bias, layer.post_norm,
                                                    layer.gate_up_weight, layer.gate_up_bias, layer.down_weight,
                                                    layer.down_bias, self.eps)
        return rms_norm(hidden, self.norm_weight, self.eps)


def _lm_head_weight(hf_model: nn.Module, embed_weight: torch.Tensor) -> torch.Tensor | None:
    """The LM head matrix: the CausalLM's own (already tied by transformers), else the tied embedding."""
    output = hf_model.get_output_embeddings()
    if isinstance(output, nn.Linear):
        return output.weight
    return embed_weight if getattr(hf_model.config, "tie_word_embeddings", False) else None
