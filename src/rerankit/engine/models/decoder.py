"""Packed forward of Llama-style decoders: Llama, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

The body runs over a ``PackedBatch``: tokens of many sequences end to end, no padding, attention
masked per sequence (and per MIS item span) by ``packed_attention``. Weights are the loaded
transformers model's own tensors; q/k/v and gate/up are fused once at load time (see ``fuse_rows``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rerankit.engine import launch_replay
from rerankit.engine.batch import PackedBatch
from rerankit.engine.models.layers import (
    PackedBody,
    apply_rotary,
    default_attention,
    fuse_rows,
    layer_steps,
    residual_projection,
    rms_norm,
    rope_inverse_frequencies,
    rope_unsupported_reason,
    rotary_cos_sin,
    swiglu,
    takes_reads,
)
from rerankit.engine.prefix_cache import CachedKV
from rerankit.errors import ModelLoadError
from rerankit.kernels import takes_head_dim

MODEL_TYPES = ("llama", "qwen2", "qwen3")
FUSED_QK_ENV = "RERANKIT_FUSED_QK"
# Below this many tokens an eagerly launched micro-batch is bound by the host's launches, so it runs the steps that
# launch least; from it on (and in a CUDA graph, where launches cost nothing) the steps that take least GPU time:
# - the fused q/k kernel, when chosen automatically. H100, pairs.py --ab (Qwen3-0.6B shape): W1 (26.7k tokens)
#   62.0 ms fused vs 64.3 ms torch; W3 (5.4k tokens, eager) p50 29.0 ms fused vs 19.0 ms torch.
# - the residual projections behind ``residual_projection``: W1 61.4 vs 63.0 ms; W3 (eager) 33.0 vs 25.3 ms.
FUSED_QK_MIN_TOKENS = 12288
# The SwiGLU GEMM (``fused_swiglu``) by default up to these hidden sizes: through tensor descriptors (Hopper on) and
# through pointers. H100, benchmarks/swiglu_matmul.py, against cuBLAS + Inductor's activation: descriptors 1.44-1.53x
# at d=1,024 (Qwen3-0.6B), 1.10-1.26x at d=2,560 (4B), 1.00-1.14x at d=4,096 (8B); pointers 1.11-1.16x at
# d=1,024 and 0.90-0.98x at d=2,560. It saves the activation's memory traffic, ~1.5/d bytes a FLOP, against
# cuBLAS's faster GEMM.
FUSED_SWIGLU_MAX_HIDDEN = 4096
FUSED_SWIGLU_MAX_HIDDEN_POINTERS = 2048
# The q/k/v GEMM with the q/k norm and rotary in its epilogue (``fused_qkv_rope``), by default up to this hidden size
# and from this many tokens. H100, benchmarks/qkv_rope.py, against cuBLAS's projection + qk_norm_rope: 1.10x at LI's
# 14.6k tokens and 1.07x at 26.6k on Qwen3-0.6B's d=1,024, 0.94x at 5k; 1.00-1.02x at d=2,560, 0.88-1.00x at d=4,096
# (cuBLAS's GEMM runs at 650-740 TFLOP/s there, ours at 540-630: the q/k pass it saves is a smaller share).
FUSED_QKV_ROPE_MAX_HIDDEN = 2048
FUSED_QKV_ROPE_MIN_TOKENS = 8192

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


def resolve_fused_qk(fused_qk: bool | None, device: torch.device, head_dim: int) -> tuple[bool, int]:
    """Whether the decoder runs ``qk_norm_rope`` (see ``PackedDecoder``), and from how many tokens a micro-batch: the
    argument, else $RERANKIT_FUSED_QK (either: every batch), else on CUDA where the kernel takes the head size, for
    batches of ``FUSED_QK_MIN_TOKENS`` and more."""
    if fused_qk is None:
        setting = os.environ.get(FUSED_QK_ENV, "").strip()
        if setting not in ("", "0", "1"):
            raise ValueError(f"{FUSED_QK_ENV} must be 0 or 1, got {setting!r}")
        if not setting:
            return device.type == "cuda" and takes_head_dim(head_dim), FUSED_QK_MIN_TOKENS
        fused_qk = setting == "1"
    if fused_qk and not takes_head_dim(head_dim):
        raise ValueError(f"fused_qk needs a head_dim that is a power of two >= 16, this model has {head_dim}")
    return fused_qk, 0


def qkv_projection(hidden: torch.Tensor, input_norm: torch.Tensor, qkv_weight: torch.Tensor,
                   qkv_bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Input norm and the fused q/k/v projection: [T, (Hq + 2 * Hkv) * D], each token's q, k then v heads."""
    return F.linear(rms_norm(hidden, input_norm, eps), qkv_weight, qkv_bias)


def attention_inputs(hidden: torch.Tensor, input_norm: torch.Tensor, qkv_weight: torch.Tensor,
                     qkv_bias: torch.Tensor | None, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer up to attention: norm, fused q/k/v, optional per-head q/k norm, rotary. Heads [T, H, D]."""
    qkv = qkv_projection(hidden, input_norm, qkv_weight, qkv_bias, eps)
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
                             down_bias: torch.Tensor | None, eps: float,
                             opaque_residual: bool = False) -> torch.Tensor:
    """The rest of one layer: output projection, residual, norm, SwiGLU MLP, residual. ``opaque_residual``: the
    two residual projections go through ``residual_projection``, so that Inductor adds them in its norm kernels
    instead of copying the residual into an ``addmm``."""
    project = residual_projection if opaque_residual else F.linear
    hidden = hidden + project(attention.flatten(1), o_weight, o_bias)
    return hidden + swiglu(rms_norm(hidden, post_norm, eps), gate_up_weight, gate_up_bias, down_weight, down_bias,
                           opaque_down=opaque_residual)


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


class PackedDecoder(PackedBody):
    """Padding-free forward of a Llama/Qwen2/Qwen3 body over a ``PackedBatch``.

    ``compile`` runs the per-layer math around attention through ``torch.compile`` (attention is the
    ``attention_fn``'s own business); None compiles on CUDA only, as measured in ``layer_steps``.
    ``attention_fn`` defaults to ``rerankit.engine.attention.packed_attention``.

    ``fused_qk`` chooses how q and k are made ready for attention. True: the (compiled) step ends at the q/k/v
    projection, and the Triton kernel ``rerankit.kernels.qk_norm_rope`` then applies the per-head q/k RMSNorm
    (Qwen3) and the rotary embedding in one pass, angles from the position ids in float32. False: the pure-torch
    ``attention_inputs`` does it all (the reference, and the CPU path). None: $RERANKIT_FUSED_QK (0 or 1) when it
    is set, else on CUDA only and where head_dim is a power of two >= 16, and then only for micro-batches of at
    least ``FUSED_QK_MIN_TOKENS`` tokens (below that the host's launches bound the time, and one compiled step per
    layer launches faster than a step plus a Triton kernel) or captured in a CUDA graph. The choice is the
    ``fused_qk`` and ``fused_qk_min_tokens`` attributes, which may be switched between forwards.

    ``unfused_residual`` (wherever the steps are compiled, so on CUDA by default; same batch rule as the automatic
    ``fused_qk``): the output and down projections go through ``residual_projection``, so the residual adds fuse
    into the norm kernels instead of Inductor's ``addmm``, which copies the residual first. Same math; a little
    more host time per layer.

    ``fused_swiglu`` (same batch rule): the gate/up projection and its activation run as one Triton GEMM
    (``rerankit.kernels.swiglu_matmul``), and the output and down projections add onto the residual stream in
    place. None: on CUDA for hidden sizes up to ``FUSED_SWIGLU_MAX_HIDDEN`` (``FUSED_SWIGLU_MAX_HIDDEN_POINTERS``
    before Hopper), where it measured faster.

    ``triton_norms`` (the attribute; True by default): where the fused q/k kernel and the SwiGLU GEMM run, the two
    RMSNorms of a layer are one Triton launch each (``rerankit.kernels.rms_norm``) instead of compiled steps, whose
    guards and wrapper cost several times a launch's host time in an eager micro-batch.

    ``fused_qkv_rope`` (the attribute; True on GPUs with the copy engine, Hopper on, for hidden sizes up to
    ``FUSED_QKV_ROPE_MAX_HIDDEN``): in micro-batches of ``FUSED_QKV_ROPE_MIN_TOKENS`` or more that run the fused
    q/k kernel with the Triton norms, the q/k/v projection and the q/k norm and rotary are one Triton GEMM
    (``rerankit.kernels.qkv_rope_matmul``) instead of cuBLAS's projection and ``qk_norm_rope``, which reads the q
    and k heads back. The angles' cos/sin table is built once a forward.

    ``last_layer_reads`` (the attribute; True by default): in ``forward_read`` the last layer's attention computes
    only the read rows (``packed_attention(..., reads=)``; the Triton kernel then runs one program per read token),
    since no other row goes on past it. Custom ``attention_fn``s compute every row, and the read ones are kept.

    ``fp8``: the q/k/v, o, gate/up and down weights are quantized to float8_e4m3fn per output channel (or taken as
    they are from ``fp8_weights``, an FP8 checkpoint's, by transformers module name) and each layer runs
    ``engine.models.fp8``'s steps instead of the ones above: activations quantized per token before each FP8 GEMM,
    the rest in the model's dtype (bf16). The ``fp8`` attribute is then the ``Fp8Ops`` it runs: the kernels on
    CUDA, their torch references elsewhere or with $RERANKIT_FP8_REFERENCE=1.
    """

    def __init__(self, hf_model: nn.Module, compile: bool | None = None,
                 attention_fn: AttentionFn | None = None, fused_qk: bool | None = None,
                 fused_swiglu: bool | None = None, fp8: bool = False,
                 fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
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
        self.fused_qk, self.fused_qk_min_tokens = resolve_fused_qk(fused_qk, device, self.head_dim)
        (self._attention_inputs, self._qkv_projection, self._attention_output_and_mlp,
         self._attention_output_and_mlp_unfused, self._rms_norm) = layer_steps(
            attention_inputs, qkv_projection, attention_output_and_mlp,
            functools.partial(attention_output_and_mlp, opaque_residual=True), rms_norm, compile=compile,
            device=device)
        # Only Inductor turns the residual add into addmm: eager steps keep F.linear. From FUSED_QK_MIN_TOKENS
        # tokens, or in a CUDA graph.
        self.unfused_residual = self._attention_output_and_mlp is not attention_output_and_mlp
        if fused_swiglu is None:
            fused_swiglu = _fused_swiglu_pays(device, config.hidden_size)
        self.fused_swiglu = fused_swiglu  # same batch rule as unfused_residual
        self.triton_norms = True
        from rerankit.kernels.swiglu_matmul import has_copy_engine

        self.fused_qkv_rope = has_copy_engine(device) and config.hidden_size <= FUSED_QKV_ROPE_MAX_HIDDEN
        self.fused_qkv_rope_min_tokens = FUSED_QKV_ROPE_MIN_TOKENS
        self.last_layer_reads = True
        self.fp8 = None
        self.replayed_steps = 0  # the last eager forward's steps replayed (engine.launch_replay)
        if fp8:
            from rerankit.engine.fp8 import per_channel, projections, reference_mode
            from rerankit.engine.models import fp8 as fp8_layers

            stored = fp8_weights or {}
            chosen = projections(config.hidden_size)
            kept = tuple(path.rpartition(".")[2] for name in chosen for path in fp8_layers.PROJECTIONS[name])
            with torch.no_grad():  # the stored weights of the projections quantized, per channel (by module id);
                given = {id(module): per_channel(*stored[name])  # the others run dequantized
                         for name, module in hf_model.named_modules() if name in stored and name.endswith(kept)}
            fp8_layers.quantize_layers(self.layers, body.layers, given, chosen)
            kernels = device.type == "cuda" and not reference_mode()
            self.fp8 = fp8_layers.KERNELS if kernels else fp8_layers.REFERENCE

    @torch.no_grad()
    def keep_prefix(self, batch: PackedBatch) -> CachedKV:
        """Each layer's keys and values (after norm and rotary) of ``batch``, a head packed as one sequence from
        position 0: what a sequence that begins with it attends to (``engine.prefix_cache``)."""
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        # graphed=True: the steps of large batches (fused q/k kernel...), as the batches that read these keys run.
        self._run(batch, None, True, kv_sink=kept)
        return CachedKV([k for k, _ in kept], [v for _, v in kept])

    def _run(self, batch: PackedBatch, read_positions: torch.Tensor | None, graphed: bool,
             cached_kv: CachedKV | None = None, kv_sink: list | None = None) -> torch.Tensor:
        """The forward (see ``PackedBody``); ``kv_sink`` collects each layer's (keys, values), contiguous."""
        attention = self._attention_fn or default_attention()
        hidden = F.embedding(batch.input_ids, self.embed_weight)
        fused_qk = self.fused_qk and (graphed or batch.num_tokens >= self.fused_qk_min_tokens) and self.fp8 is None
        large = graphed or batch.num_tokens >= FUSED_QK_MIN_TOKENS
        finish = self._attention_output_and_mlp_unfused if self.unfused_residual and large else \
            self._attention_output_and_mlp
        if self.fused_swiglu and large:
            finish = self._attention_output_and_fused_mlp
        if not fused_qk and self.fp8 is None:
            cos, sin = rotary_cos_sin(batch.position_ids, self.inv_freq, hidden.dtype)
        rope = None
        if self.fp8 is not None:
            from rerankit.engine.models import fp8 as fp8_layers
            from rerankit.kernels.qkv_rope_matmul import rope_table

            rope = rope_table(batch.position_ids, self.inv_freq)
        if fused_qk and self.fused_qkv_rope and self.triton_norms and \
                batch.num_tokens >= self.fused_qkv_rope_min_tokens:
            from rerankit.kernels.qkv_rope_matmul import rope_table, takes_tma

            if takes_tma(hidden, self.layers[0].qkv_weight, self.head_dim):  # else the kernel's torch reference
                rope = rope_table(batch.position_ids, self.inv_freq)
        last = len(self.layers) - 1
        # In the last layer only the read rows go on past attention (1.5% of the W1 forward on an H100,
        # benchmarks/forward.py); the default attention then computes only their rows.
        attention_reads = takes_reads(attention)
        last_reads = {"reads": read_positions} if read_positions is not None and self.last_layer_reads and \
            attention_reads else {}
        pending = None  # FP8: the down projection's output, added by the next layer's norm kernel
        ops, replay = self.fp8, None
        if ops is not None and ops.kernels and not graphed and launch_replay.enabled():
            replay = launch_replay.LayerReplay()  # later layers launch what the first one launched
            ops, attention = replay.wrap(ops), replay.step("attention", attention)
        for index, layer in enumerate(self.layers):
            if replay is not None:
                replay.next_layer()
            if ops is not None:
                q, k, v = fp8_layers.attention_inputs(hidden, pending, layer, rope, batch.position_ids,
                                                      self.inv_freq, self.num_heads, self.num_kv_heads,
                                                      self.head_dim, self.eps, ops)
            elif fused_qk:
                q, k, v = self._fused_attention_inputs(hidden, layer, batch.position_ids, rope)
            else:
                q, k, v = self._attention_inputs(hidden, layer.input_norm, layer.qkv_weight, layer.qkv_bias,
                                                 layer.q_norm, layer.k_norm, cos, sin, self.eps, self.num_heads,
                                                 self.num_kv_heads, self.head_dim)
            if kv_sink is not None:
                kv_sink.append((k.contiguous(), v.contiguous()))
            options = dict(last_reads) if index == last else {}  # the attention call's keywords
            # FP8 o projection: its input's bound; the Triton attention writes the codes itself (engine.models.fp8)
            kept = None if cached_kv is None else cached_kv.values[index]
            bound = fp8_layers.o_input_bound(v, layer, ops, kept) if ops is not None else None
            if bound is not None and ops.kernels and attention_reads:
                options["fp8_bound"] = bound
            if cached_kv is not None:
                options["cached"] = (cached_kv.keys[index], kept)
            attended = attention(q, k, v, batch, scale=self.scale, **options)
            if index == last and read_positions is not None:
                hidden = hidden[read_positions]
                if "reads" not in options:
                    attended = tuple(part[read_positions] for part in attended) if isinstance(attended, tuple) \
                        else attended[read_positions]
            if ops is not None:
                hidden, pending = fp8_layers.output_and_mlp(attended, hidden, layer, self.eps, ops, bound)
            else:
                hidden = finish(attended, hidden, layer.o_weight, layer.o_bias, layer.post_norm,
                                layer.gate_up_weight, layer.gate_up_bias, layer.down_weight, layer.down_bias, self.eps)
        if pending is not None:
            hidden = hidden.add_(pending)
        if replay is not None:
            self.replayed_steps = replay.replayed
        return rms_norm(hidden, self.norm_weight, self.eps)

    def _attention_output_and_fused_mlp(self, attended: torch.Tensor, hidden: torch.Tensor, o_weight: torch.Tensor,
                                        o_bias: torch.Tensor | None, post_norm: torch.Tensor,
                                        gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
                                        down_weight: torch.Tensor, down_bias: torch.Tensor | None,
                                        eps: float) -> torch.Tensor:
        """``attention_output_and_mlp`` with the gate/up projection and SwiGLU in ``swiglu_matmul`` (one Triton
        GEMM writing [T, I] instead of [T, 2I] read back by an elementwise kernel), and both residual projections
        added onto the residual stream in place by cuBLAS (C += A @ B: no copy, no separate add). ``hidden`` is the
        forward's own tensor (the embedding, a gather, or the previous layer's), so updating it in place is safe."""
        from rerankit.kernels.swiglu_matmul import swiglu_matmul  # imported at first use, like the other kernels

        _add_projection(hidden, attended.flatten(1), o_weight, o_bias)
        activated = swiglu_matmul(self._norm(hidden, post_norm, eps), gate_up_weight, gate_up_bias)
        return _add_projection(hidden, activated, down_weight, down_bias)

    def _fused_attention_inputs(self, hidden: torch.Tensor, layer: PackedDecoderLayer, position_ids: torch.Tensor,
                                rope: tuple[torch.Tensor, torch.Tensor] | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``attention_inputs`` with the per-head norm and rotary in ``qk_norm_rope``; v a view of the projection.
        With ``rope`` (the forward's cos/sin table) they are the q/k/v GEMM's epilogue, and q and k are views too."""
        from rerankit.kernels.qk_norm_rope import qk_norm_rope  # imported at first use, like the attention kernel

        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if rope is not None:
            from rerankit.kernels.qkv_rope_matmul import qkv_rope_matmul

            qkv = qkv_rope_matmul(self._norm(hidden, layer.input_norm, self.eps), layer.qkv_weight, layer.qkv_bias,
                                  heads, kv_heads, head_dim, *rope, layer.q_norm, layer.k_norm, self.eps)
            q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            return q.unflatten(-1, (heads, head_dim)), k.unflatten(-1, (kv_heads, head_dim)), \
                v.unflatten(-1, (kv_heads, head_dim))
        if self.triton_norms:
            qkv = F.linear(self._norm(hidden, layer.input_norm, self.eps), layer.qkv_weight, layer.qkv_bias)
        else:
            qkv = self._qkv_projection(hidden, layer.input_norm, layer.qkv_weight, layer.qkv_bias, self.eps)
        q, k = qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim, position_ids, self.inv_freq,
                            layer.q_norm, layer.k_norm, self.eps)
        v = qkv[:, (self.num_heads + self.num_kv_heads) * self.head_dim:]
        return q, k, v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """A layer's RMSNorm on the fused path: the Triton kernel (``triton_norms``) or the compiled step."""
        if not self.triton_norms:
            return self._rms_norm(hidden, weight, eps)
        from rerankit.kernels.rms_norm import rms_norm as rms_norm_rows

        return rms_norm_rows(hidden, weight, eps)


def _fused_swiglu_pays(device: torch.device, hidden_size: int) -> bool:
    """Whether the SwiGLU GEMM measured faster than cuBLAS + the compiled activation for this hidden size."""
    from rerankit.kernels.swiglu_matmul import has_copy_engine

    if device.type != "cuda":
        return False
    return hidden_size <= (FUSED_SWIGLU_MAX_HIDDEN if has_copy_engine(device) else FUSED_SWIGLU_MAX_HIDDEN_POINTERS)


def _add_projection(hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden += x @ weight.T (+ bias)`` in place."""
    hidden.addmm_(x, weight.t())
    if bias is not None:
        hidden.add_(bias)
    return hidden


def _lm_head_weight(hf_model: nn.Module, embed_weight: torch.Tensor) -> torch.Tensor | None:
    """The LM head matrix: the CausalLM's own (already tied by transformers), else the tied embedding."""
    output = hf_model.get_output_embeddings()
    if isinstance(output, nn.Linear):
        return output.weight
    return embed_weight if getattr(hf_model.config, "tie_word_embeddings", False) else None
