"""The fused q/k/v projection with the per-head q/k RMSNorm (Qwen3) and the rotary embedding in its epilogue.

Without it a decoder layer runs cuBLAS's ``x @ Wqkv.T`` ``[T, (Hq + 2 * Hkv) * D]`` and then ``qk_norm_rope``,
which reads the q and k heads back and writes them again: at Qwen3-0.6B's 16 + 8 heads of 128 that is 12 KB a token
a layer, ~65 us of an H100 for LI's 14.6k tokens. Here a program computes a tile of whole heads (``HEADS`` of them,
all q, all k or all v), so each row of a q or k head is in its registers at once: it rounds the projection to the output
dtype (as ``F.linear`` does), normalises and rotates q and k heads exactly as ``qk_norm_rope`` does (float32, one
rounding at the store) and stores v heads as they are. The output keeps the projection's layout, so q, k and v are
views of it.

Angles come from a float32 ``cos``/``sin`` table ``[T, D/2]`` that the caller builds once a forward
(``rope_table``), so the epilogue reads them instead of computing a sine and a cosine per element of each tile.

**FP8**: float8_e4m3fn ``x`` and weight with per-row ``x_scale`` and per-output-channel ``w_scale`` (output bf16):
FP8 tiles into ``tl.dot`` (float32 accumulator), the scales applied in the epilogue before the bias and the rest of
it; tiles up to 128 deep in K.

One kernel: persistent, tiles through tensor descriptors (Hopper's copy engine), as ``swiglu_matmul``'s. It runs
on CUDA tensors where ``takes_tma`` holds, or on CPU tensors when TRITON_INTERPRET=1; elsewhere
``qkv_rope_matmul`` computes the reference (``F.linear`` then ``qk_norm_rope``), so callers need not check. FP8
projections of 2,048 tokens or more on sm_90 go to its warp-specialized Gluon twin (``qkv_rope_ws``: the same
output bit for bit, 4-7% sooner); ``$RERANKIT_QKV_KERNEL=triton`` keeps them here.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from rerankit.kernels import cuda_capability, launch_tuned, run_gluon, sm_count, takes_head_dim
from rerankit.kernels.fp8_matmul import project_reference
from rerankit.kernels.fp8_quant import FP8_DTYPE, check_scaled

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still serves machines without triton
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older triton: the reference only
    TensorDescriptor = None

# Triton decides at decoration time whether a kernel is interpreted, so read the flag at the same moment.
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_ENV = "RERANKIT_QKV_KERNEL"  # "triton": FP8 projections skip the warp-specialized kernel (an A/B's other side)


def rope_table(position_ids: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """float32 cos and sin ``[T, D/2]`` of the angles ``position * inv_freq`` (as ``qk_norm_rope`` computes them)."""
    angles = position_ids.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    return angles.cos(), angles.sin()


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, num_heads: int, num_kv_heads: int, head_dim: int,
           cos: Tensor, sin: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, x_scale: Tensor | None = None,
           w_scale: Tensor | None = None) -> None:
    check_scaled(x, weight, x_scale, w_scale)
    if not takes_head_dim(head_dim):
        raise ValueError(f"qkv_rope_matmul needs a head_dim that is a power of two >= 16, got {head_dim}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if x.dim() != 2 or weight.shape != (width, x.shape[-1]):
        raise ValueError(f"x must be [T, d] and weight [{width}, d] ({num_heads} + 2 x {num_kv_heads} heads of "
                         f"{head_dim}), got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and bias.shape != (width,):
        raise ValueError(f"bias must be [{width}], got {tuple(bias.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (x.shape[0], head_dim // 2) or table.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [{x.shape[0]}, {head_dim // 2}], got {table.dtype} "
                             f"{tuple(table.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm, or neither")
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is not None and norm.shape != (head_dim,):
            raise ValueError(f"{name} must be [{head_dim}], got {tuple(norm.shape)}")


def qkv_rope_matmul_reference(x: Tensor, weight: Tensor, bias: Tensor | None, num_heads: int, num_kv_heads: int,
                              head_dim: int, cos: Tensor, sin: Tensor, q_norm: Tensor | None = None,
                              k_norm: Tensor | None = None, eps: float = 1e-6, *, x_scale: Tensor | None = None,
                              w_scale: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Plain torch: ``F.linear`` (FP8: ``fp8_matmul_reference`` in ``out_dtype``), then each q and k head normed
    and rotated as ``qk_norm_rope`` does it (float32, one rounding), with the table's angles."""
    _check(x, weight, bias, num_heads, num_kv_heads, head_dim, cos, sin, q_norm, k_norm, x_scale, w_scale)
    qkv = project_reference(x, weight, bias, x_scale, w_scale, out_dtype)
    half = head_dim // 2
    out = qkv.clone()
    for start, count, norm in ((0, num_heads, q_norm), (num_heads * head_dim, num_kv_heads, k_norm)):
        heads = qkv[:, start:start + count * head_dim].unflatten(-1, (count, head_dim)).float()
        if norm is not None:
            heads = norm.float() * (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps))
        first, second = heads[..., :half], heads[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat((first * c - second * s, second * c + first * s), dim=-1)
        out[:, start:start + count * head_dim] = rotated.flatten(1).to(qkv.dtype)
    return out


def qkv_rope_matmul(x: Tensor, weight: Tensor, bias: Tensor | None, num_heads: int, num_kv_heads: int,
                    head_dim: int, cos: Tensor, sin: Tensor, q_norm: Tensor | None = None,
                    k_norm: Tensor | None = None, eps: float = 1e-6, *, x_scale: Tensor | None = None,
                    w_scale: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``x @ weight.T + bias`` ``[T, (Hq + 2 * Hkv) * D]`` with each q and k head normed (when ``q_norm``/``k_norm``
    are given) and rotated by the angles of ``cos``/``sin`` (``rope_table``, float32 ``[T, D/2]``); v heads as
    projected. ``weight`` is the fused q/k/v weight (q rows, then k, then v). FP8 ``x`` and ``weight`` take their
    float32 scales ``x_scale`` [T] and ``w_scale`` [N] and give ``out_dtype``. Falls back to the reference where the
    kernel does not apply (``takes_tma``)."""
    if triton is None or not (x.is_cuda or _INTERPRET) or not takes_tma(x, weight, head_dim):
        return qkv_rope_matmul_reference(x, weight, bias, num_heads, num_kv_heads, head_dim, cos, sin, q_norm,
                                         k_norm, eps, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype)
    _check(x, weight, bias, num_heads, num_kv_heads, head_dim, cos, sin, q_norm, k_norm, x_scale, w_scale)
    fp8 = x.dtype == FP8_DTYPE
    if fp8 and x.is_cuda and out_dtype == torch.bfloat16 and os.environ.get(KERNEL_ENV) != "triton":
        from rerankit.kernels import qkv_rope_ws  # Gluon's import: only where it may run

        if qkv_rope_ws.takes_ws(x, weight, num_heads, num_kv_heads, head_dim):
            out = run_gluon("q/k/v GEMM", lambda: qkv_rope_ws.qkv_rope_ws(
                x, weight, bias, num_heads, num_kv_heads, head_dim, cos, sin, q_norm, k_norm, eps, x_scale, w_scale))
            if out is not None:
                return out
    x, weight = x.contiguous(), weight.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    tokens, width = x.shape[0], weight.shape[0]
    out = torch.empty(tokens, width, dtype=out_dtype if fp8 else x.dtype, device=x.device)
    if tokens == 0:
        return out
    x_desc, w_desc, out_desc = (TensorDescriptor.from_tensor(t, [16, 16]) for t in (x, weight, out))
    programs = sm_count(x.device, interpreted=4)  # the persistent kernel: one program per SM
    grid = lambda meta: (min(programs, triton.cdiv(tokens, meta["BLOCK_M"])  # noqa: E731
                             * triton.cdiv(width, meta["HEADS"] * head_dim)),)
    has_norm = q_norm is not None
    scales = (x_scale.float().contiguous(), w_scale.float().contiguous()) if fp8 else (cos, cos)
    args = (x_desc, w_desc, bias if bias is not None else cos, *scales, out_desc, cos, sin,
            q_norm if has_norm else cos, k_norm if has_norm else cos,  # unread without HAS_NORM / HAS_BIAS / SCALED
            tokens, width, x.shape[1], eps)
    meta = dict(HEAD_DIM=head_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HAS_BIAS=bias is not None,
                HAS_NORM=has_norm, SCALED=fp8, NUM_SMS=programs)
    if _INTERPRET:  # one small tile, the widest of whole heads that keeps q, k and v apart: no tuning
        tile = dict(BLOCK_M=16, BLOCK_K=16, GROUP_M=2, HEADS=max(h for h in (2, 1) if _uniform(h, meta)))
        x_desc.block_shape, w_desc.block_shape = [16, 16], [tile["HEADS"] * head_dim, 16]
        out_desc.block_shape = [16, tile["HEADS"] * head_dim]
        _qkv_rope_kernel_interpreted[grid](*args, **meta, **tile)
    else:  # descriptors' block shapes are set per tuning config by _set_block_shapes
        descriptors = {"x_desc": x_desc, "w_desc": w_desc, "out_desc": out_desc, "HEAD_DIM": head_dim}
        key = (width, x.shape[1], head_dim, num_heads, num_kv_heads, x.dtype, bias is not None, has_norm, programs)
        launch_tuned(_qkv_rope_fp8_kernel if fp8 else _qkv_rope_kernel, key, grid, args, meta,
                     lambda config: _set_block_shapes({**descriptors, **config.kwargs}), tokens)
    return out


def takes_tma(x: Tensor, weight: Tensor, head_dim: int) -> bool:
    """Whether the kernel applies: 16-bit or float8 inputs on a GPU with the copy engine (Hopper on; any dtype in
    the interpreter), rows of x and the weight in 16-byte multiples, and a head size whose tiles fit (D <= 256)."""
    if triton is None or TensorDescriptor is None or not takes_head_dim(head_dim) or head_dim > 256:
        return False
    multiple = 16 // x.element_size()
    aligned = x.shape[-1] % multiple == 0 and weight.shape[0] % multiple == 0
    if _INTERPRET and not x.is_cuda:
        return aligned
    return (aligned and (x.element_size() == 2 or x.dtype == FP8_DTYPE) and x.is_cuda and TensorDescriptor is not None
            and cuda_capability(x.device)[0] >= 9)


if triton is not None:
    from rerankit.kernels.swiglu_matmul import grouped_tile

    @triton.jit
    def _norm_rotate(acc, b_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, pid_m, pid_n, M, N, eps,
                     out_type: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                     SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The epilogue of one [BLOCK_M, BLOCK_N] tile of BLOCK_N / HEAD_DIM whole heads, all q, all k or all v
        (``_uniform``): the FP8 scales (``SCALED``), bias, F.linear's rounding, then for q and k heads
        qk_norm_rope's norm and rotation in float32; v heads pass through."""
        HALF: tl.constexpr = HEAD_DIM // 2
        HEADS: tl.constexpr = BLOCK_N // HEAD_DIM
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if SCALED:
            scale_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            acc = acc * tl.load(xs_ptr + scale_rows, mask=scale_rows < M, other=0.0)[:, None] \
                * tl.load(ws_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        acc = acc.to(out_type)
        first_head = pid_n * HEADS
        if first_head < NUM_HEADS + NUM_KV_HEADS:
            # [BLOCK_M, HEADS, HALF, 2]: the first and the second half of each head side by side
            first, second = tl.split(tl.permute(tl.reshape(acc.to(tl.float32), (BLOCK_M, HEADS, 2, HALF)),
                                                (0, 1, 3, 2)))
            dims = tl.arange(0, HALF)
            if HAS_NORM:
                is_q = first_head < NUM_HEADS
                w_first = tl.where(is_q, tl.load(q_norm_ptr + dims), tl.load(k_norm_ptr + dims)).to(tl.float32)
                w_second = tl.where(is_q, tl.load(q_norm_ptr + HALF + dims),
                                    tl.load(k_norm_ptr + HALF + dims)).to(tl.float32)
                scale = tl.rsqrt((tl.sum(first * first, axis=2) + tl.sum(second * second, axis=2)) / HEAD_DIM
                                 + eps)[:, :, None]
                first = w_first[None, None, :] * (first * scale)
                second = w_second[None, None, :] * (second * scale)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            table = rows.to(tl.int64)[:, None] * HALF + dims[None, :]
            row_ok = (rows < M)[:, None]
            cos = tl.load(cos_ptr + table, mask=row_ok, other=0.0)[:, None, :]
            sin = tl.load(sin_ptr + table, mask=row_ok, other=0.0)[:, None, :]
            both = tl.join(first * cos - second * sin, second * cos + first * sin)
            acc = tl.reshape(tl.permute(both, (0, 1, 3, 2)), (BLOCK_M, BLOCK_N)).to(out_type)
        return acc

    def _qkv_rope_body(x_desc, w_desc, b_ptr, xs_ptr, ws_ptr, out_desc, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, M,
                       N, K, eps, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, SCALED: tl.constexpr, NUM_SMS: tl.constexpr,
                       BLOCK_M: tl.constexpr, HEADS: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """Persistent: NUM_SMS programs walk the output tiles, the loop flattened so that the next tile's loads
        overlap this tile's epilogue and store (as ``swiglu_matmul``'s descriptor kernel); a tile is BLOCK_M tokens
        of HEADS heads. Past the edges the copy engine reads zeros and the store drops what lies outside."""
        BLOCK_N: tl.constexpr = HEADS * HEAD_DIM
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        steps = tl.cdiv(K, BLOCK_K)
        stored = tl.program_id(0) - NUM_SMS  # the epilogue's tile, counted apart from the loads'
        for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
            pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(steps):
                acc = tl.dot(x_desc.load([pid_m * BLOCK_M, step * BLOCK_K]),
                             w_desc.load([pid_n * BLOCK_N, step * BLOCK_K]).T, acc)
            stored += NUM_SMS
            pid_m, pid_n = grouped_tile(stored, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            out = _norm_rotate(acc, b_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, pid_m, pid_n,
                               M, N, eps, out_desc.dtype, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, HAS_BIAS, HAS_NORM,
                               SCALED, BLOCK_M, BLOCK_N)
            out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)

    def _set_block_shapes(nargs: dict) -> None:
        """Each tuning config's tile shapes into the descriptors (they are built before a config is chosen)."""
        block_m, block_n, block_k = nargs["BLOCK_M"], nargs["HEADS"] * nargs["HEAD_DIM"], nargs["BLOCK_K"]
        nargs["x_desc"].block_shape = [block_m, block_k]
        nargs["w_desc"].block_shape = [block_n, block_k]
        nargs["out_desc"].block_shape = [block_m, block_n]

    def _prune(configs, nargs, **kwargs):
        """Configs whose tiles keep q, k and v heads apart (one head a tile always does)."""
        named = {**nargs, **kwargs}
        return [config for config in configs if _uniform(config.kwargs["HEADS"], named)]

    # A [128, 256] fp32 accumulator with 8 warps (two heads of 128) ran swiglu_matmul's GEMM fastest at d=1,024. Here
    # the epilogue's cos/sin shuffle takes 32 KB of shared memory, so the two-head tile fits 2 stages of 64-wide K
    # steps or up to 5 of 32-wide ones (221 KB). H100, Qwen3-0.6B, 14.6k tokens: 32-wide K in 4 stages 0.219 ms,
    # 64-wide in 2 stages 0.251, one head a tile 0.246-0.274 (4-warp and 64-token tiles 0.318-0.355).
    _CONFIGS = [
        triton.Config({"BLOCK_M": 128, "HEADS": heads, "BLOCK_K": block_k, "GROUP_M": 8}, num_warps=8,
                      num_stages=stages, pre_hook=_set_block_shapes)
        for heads, block_k, stages in ((2, 32, 5), (2, 32, 4), (2, 64, 2), (1, 64, 4), (1, 32, 6))
    ]
    _qkv_rope_kernel = triton.autotune(_CONFIGS, key=["M", "N", "K", "HEAD_DIM", "NUM_HEADS", "NUM_KV_HEADS"],
                                       prune_configs_by={"early_config_prune": _prune})(triton.jit(_qkv_rope_body))
    # FP8 tiles take half the shared memory of 16-bit ones: the 16-bit configs' stages at twice the K depth, and
    # 128-deep steps (a [256, 128] weight tile is 32 KB). Beside the stages, the epilogue holds the [128, 256] bf16
    # output tile (64 KB) and the cos/sin shuffle (32 KB), so two heads fit 5 stages of 64-deep steps (221 KB) or 2
    # of 128-deep ones (197 KB), not 7 or 3 (264 / 240 KB, over sm_90's 227 KB). H100, ms at 4k tokens of the 4B
    # shape / W1's 26.6k of the 0.6B: (2, 64, 5) 0.119 / 0.277, (2, 64, 4) 0.121 / 0.277 (ahead at 4B's 8k: 0.254
    # against 0.258), (2, 128, 2) 0.157 / 0.301, (1, 128, 4) 0.138 / 0.315.
    _FP8_CONFIGS = [
        triton.Config({"BLOCK_M": 128, "HEADS": heads, "BLOCK_K": block_k, "GROUP_M": 8}, num_warps=8,
                      num_stages=stages, pre_hook=_set_block_shapes)
        for heads, block_k, stages in ((2, 64, 5), (2, 64, 4), (2, 128, 2), (1, 128, 4))
    ]
    _qkv_rope_fp8_kernel = triton.autotune(_FP8_CONFIGS, key=["M", "N", "K", "HEAD_DIM", "NUM_HEADS",
                                                               "NUM_KV_HEADS"],
                                           prune_configs_by={"early_config_prune": _prune})(
        triton.jit(_qkv_rope_body))
    _qkv_rope_kernel_interpreted = triton.jit(_qkv_rope_body)


def _uniform(heads: int, named: dict) -> bool:
    """Whether tiles of ``heads`` heads each hold q heads only, k heads only or v heads only, and fit (<= 256)."""
    return (heads * named["HEAD_DIM"] <= 256 and named["NUM_HEADS"] % heads == 0
            and named["NUM_KV_HEADS"] % heads == 0)
