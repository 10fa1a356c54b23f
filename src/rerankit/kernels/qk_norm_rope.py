"""Per-head q/k RMSNorm (Qwen3) and rotary embedding in one pass over the fused q/k/v projection.

`qk_norm_rope` reads the q and k heads of the qkv GEMM output ``[T, (Hq + 2 * Hkv) * D]`` once and writes
contiguous ``q [T, Hq, D]`` and ``k [T, Hkv, D]``; v stays a view of the qkv tensor. Per head row ``x``:

    x = weight * (x * rsqrt(mean(x^2) + eps))      (only with norm weights: Qwen3)
    out = x * cos + rotate_half(x) * sin            rotate_half(x) = cat(-x2, x1) over the halves of D

all in float32, rounded once at the store. The Triton kernel runs on CUDA tensors, or on CPU tensors when
TRITON_INTERPRET=1; anything else falls back to `qk_norm_rope_reference`.

Angles come from position ids and ``inv_freq``, computed in the kernel in float32, not from a precomputed cos/sin
table. One program owns a block of tokens and all of their q and k heads, so each token's cos/sin is computed
once and shared by its Hq + Hkv heads (1/24 of a sin and a cos per element at Qwen3-0.6B's 16 + 8 heads), and
the only extra bytes are the 8-byte position of each token, against a [T, D] table per layer (4% more traffic in
bf16, 8% in float32) that would also have to be built once per forward. It is also more accurate: the torch path
rounds cos/sin to the activation dtype (bf16 on the GPU) before using them, while ``tl.sin``/``tl.cos`` compile to
libdevice's full-range sinf/cosf (no ``sin.approx`` in the PTX, Triton 3.6 on an H100), so cos/sin stay
float32-accurate at 40k positions too.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from rerankit.kernels import takes_head_dim
from rerankit.kernels.direct_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still serves machines without triton
    triton = None

# Triton decides at decoration time whether a kernel is interpreted, so read the flag at the same moment.
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
# Elements of q one program holds per half head: tokens per program = this / (padded Hq * D / 2), with 4 warps.
# On an H100 at Hq=16, Hkv=8, D=128, bf16, 26.2k tokens, 2 tokens and 4 warps ran in 115 us (2.8 TB/s, the copy
# ceiling is about 3.0); the sweep over 1-16 tokens x 2-16 warps ran in 115-560 us, Inductor's norm and rotary
# of q and k in 198 us.
_HALF_TILE_ELEMENTS = 2048
_MAX_BLOCK_T = 16


def _check(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, position_ids: Tensor, inv_freq: Tensor,
           q_norm: Tensor | None, k_norm: Tensor | None) -> None:
    if not takes_head_dim(head_dim):
        raise ValueError(f"qk_norm_rope needs a head_dim that is a power of two >= 16, got {head_dim}")
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"qk_norm_rope needs at least one q and one kv head, got {num_heads} and {num_kv_heads}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [T, {width}] for {num_heads} + 2 x {num_kv_heads} heads of {head_dim}, "
                         f"got {tuple(qkv.shape)}")
    if qkv.shape[0] > 1 and qkv.stride(1) != 1:
        raise ValueError("qkv rows must be contiguous (stride 1 along the last dimension)")
    if position_ids.shape != (qkv.shape[0],):
        raise ValueError(f"position_ids must be [{qkv.shape[0]}], got {tuple(position_ids.shape)}")
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must be [{head_dim // 2}], got {tuple(inv_freq.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm, or neither")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(f"{name} must be [{head_dim}], got {tuple(weight.shape)}")


def qk_norm_rope_reference(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, position_ids: Tensor,
                           inv_freq: Tensor, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                           eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Plain-torch `qk_norm_rope`: the decoder's own ``rms_norm`` and ``apply_rotary``, cos/sin in qkv's dtype."""
    # Imported at call time: the kernel module itself does not depend on the engine package.
    from rerankit.engine.models.layers import apply_rotary, rms_norm, rotary_cos_sin

    _check(qkv, num_heads, num_kv_heads, head_dim, position_ids, inv_freq, q_norm, k_norm)
    q, k = qkv[:, :(num_heads + num_kv_heads) * head_dim].split([num_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k = q.unflatten(-1, (num_heads, head_dim)), k.unflatten(-1, (num_kv_heads, head_dim))
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos, sin = rotary_cos_sin(position_ids, inv_freq, qkv.dtype)
    return apply_rotary(q, cos, sin).contiguous(), apply_rotary(k, cos, sin).contiguous()


def qk_norm_rope(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, position_ids: Tensor,
                 inv_freq: Tensor, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                 eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Normed (when ``q_norm``/``k_norm`` are given) and rotated q [T, Hq, D] and k [T, Hkv, D], contiguous.

    ``qkv`` [T, (Hq + 2 * Hkv) * D] holds each token's q heads, then k heads, then v heads (v is not read);
    ``position_ids`` [T] (any integer dtype) and float32 ``inv_freq`` [D/2] give the angles
    ``position * inv_freq``. D must be a power of two >= 16. Outputs have qkv's dtype.
    """
    if triton is None or not (qkv.is_cuda or _INTERPRET):  # the reference checks its inputs the same way
        return qk_norm_rope_reference(qkv, num_heads, num_kv_heads, head_dim, position_ids, inv_freq, q_norm,
                                      k_norm, eps)
    _check(qkv, num_heads, num_kv_heads, head_dim, position_ids, inv_freq, q_norm, k_norm)
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q, k
    block_hq = triton.next_power_of_2(num_heads)
    block_hkv = triton.next_power_of_2(num_kv_heads)
    half_row = block_hq * head_dim // 2
    block_t = max(1, min(_MAX_BLOCK_T, _HALF_TILE_ELEMENTS // half_row, triton.next_power_of_2(tokens)))
    has_norm = q_norm is not None
    launch(
        _qk_norm_rope_kernel, (triton.cdiv(tokens, block_t),), qkv, q, k, position_ids, inv_freq.float().contiguous(),
        q_norm if has_norm else inv_freq, k_norm if has_norm else inv_freq,  # unread when HAS_NORM is False
        tokens, qkv.stride(0), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, HAS_NORM=has_norm,
        num_warps=4,
    )
    return q, k


if triton is not None:

    @triton.jit
    def _norm_rope_heads(src_rows, dst_rows, token_ok, cos, sin, norm_ptr, eps,
                         NUM: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
        """NUM heads of BLOCK_T tokens, [BLOCK_T, BLOCK_H, D/2] per half: load, norm, rotate, store."""
        HALF: tl.constexpr = HEAD_DIM // 2
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, HALF)
        offsets = heads[None, :, None] * HEAD_DIM + dims[None, None, :]
        mask = token_ok[:, None, None] & (heads < NUM)[None, :, None]
        src = src_rows[:, None, None] + offsets
        first = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            mean_square = (tl.sum(first * first, axis=2) + tl.sum(second * second, axis=2)) / HEAD_DIM
            scale = tl.rsqrt(mean_square + eps)[:, :, None]
            first = tl.load(norm_ptr + dims).to(tl.float32)[None, None, :] * (first * scale)
            second = tl.load(norm_ptr + HALF + dims).to(tl.float32)[None, None, :] * (second * scale)
        dst = dst_rows[:, None, None] + offsets
        out_type = dst_rows.dtype.element_ty
        tl.store(dst, (first * cos - second * sin).to(out_type), mask=mask)
        tl.store(dst + HALF, (second * cos + first * sin).to(out_type), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr, q_ptr, k_ptr, position_ptr, inv_freq_ptr, q_norm_ptr, k_norm_ptr,
        n_tokens, stride_qkv, eps,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, HAS_NORM: tl.constexpr,
    ):
        """One block of BLOCK_T tokens: their cos/sin once, then every q head, then every k head."""
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        token_ok = tokens < n_tokens
        positions = tl.load(position_ptr + tokens, mask=token_ok, other=0).to(tl.float32)
        inv_freq = tl.load(inv_freq_ptr + tl.arange(0, HEAD_DIM // 2))
        angles = positions[:, None] * inv_freq[None, :]
        cos = tl.cos(angles)[:, None, :]
        sin = tl.sin(angles)[:, None, :]
        rows = tokens.to(tl.int64)
        src_rows = qkv_ptr + rows * stride_qkv
        _norm_rope_heads(src_rows, q_ptr + rows * (NUM_HEADS * HEAD_DIM), token_ok, cos, sin, q_norm_ptr, eps,
                         NUM_HEADS, BLOCK_HQ, HEAD_DIM, HAS_NORM)
        _norm_rope_heads(src_rows + NUM_HEADS * HEAD_DIM, k_ptr + rows * (NUM_KV_HEADS * HEAD_DIM), token_ok, cos,
                         sin, k_norm_ptr, eps, NUM_KV_HEADS, BLOCK_HKV, HEAD_DIM, HAS_NORM)
