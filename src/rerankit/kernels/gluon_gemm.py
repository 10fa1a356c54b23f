"""What the warp-specialized FP8 GEMMs in Gluon (``qkv_rope_ws``, ``swiglu_ws``) share: Triton's Gluon Hopper ops
(``gluon`` is None where this triton lacks them), the grouped tile order, the loader partition, the tensor
descriptors of their 2-D operands, and the checks every call must pass before either kernel takes it."""

from __future__ import annotations

import functools

import torch

from rerankit.kernels import cuda_capability
from rerankit.kernels.fp8_quant import FP8_DTYPE

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    # Triton 3.6 names the copies async_copy_global_to_shared / async_copy_shared_to_global; later releases
    # async_load / async_store (where the old names raise).
    load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
except (ImportError, AttributeError):  # a triton without Gluon's Hopper ops: the Triton kernels serve every call
    gluon = gl = GluonDescriptor = None
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = load = store = None


def fp8_operands_fit(x: torch.Tensor, weight: torch.Tensor, min_tokens: int) -> bool:
    """Gluon's Hopper ops, an sm_90 device, float8 x [T, K] and weight, both contiguous and 16-byte aligned with K a
    multiple of 16 (the copy engine's rows), and at least ``min_tokens`` rows."""
    if gluon is None or not x.is_cuda or x.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        return False
    if cuda_capability(x.device)[0] != 9 or x.dim() != 2 or weight.dim() != 2:
        return False
    return (x.shape[0] >= min_tokens and x.shape[1] % 16 == 0 and x.is_contiguous() and weight.is_contiguous()
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


if gluon is not None:

    @gluon.jit
    def coords(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """Tile ``tile``'s (row block, column block), GROUP_M row blocks at a time (``swiglu_matmul.grouped_tile``)."""
        in_group = GROUP_M * gl.cdiv(N, BLOCK_N)
        first = (tile // in_group) * GROUP_M
        size = gl.minimum(gl.cdiv(M, BLOCK_M) - first, GROUP_M)
        return first + (tile % in_group) % size, (tile % in_group) // size

    @gluon.jit
    def loader(x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, W_PARTS: gl.constexpr):
        """The loader partition of a persistent GEMM: K step c of the program's tiles, in order, into slot
        c % STAGES once the slot's consumers have released it (``empty``), its arrival on ``ready``. A slot holds the
        x tile and ``W_PARTS`` weight tiles of ``BLOCK_N`` rows, part p from row ``p * N + pid_n * BLOCK_N`` (the
        SwiGLU GEMM's gate and up rows: 2)."""
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        steps = gl.cdiv(K, BLOCK_K)
        c = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            pid_m, pid_n = coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            for k in range(steps):
                s = c % STAGES
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + W_PARTS * w_desc.block_type.nbytes)
                load(x_desc, [pid_m * BLOCK_M, k * BLOCK_K], ready.index(s), x_smem.index(s))
                slot = w_smem.index(s)
                for part in gl.static_range(W_PARTS):
                    load(w_desc, [part * N + pid_n * BLOCK_N, k * BLOCK_K], ready.index(s),
                         slot.slice(part * BLOCK_N, BLOCK_N))
                c += 1


@functools.lru_cache(maxsize=16)
def smem_layout(block: tuple[int, int], dtype: torch.dtype):
    """The swizzled shared-memory layout of a ``block`` tile, computed once (host time a launch otherwise)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv if dtype == FP8_DTYPE else gl.bfloat16)


def descriptor(x: torch.Tensor, block: tuple[int, int]):
    """A tensor descriptor of the 2-D row-major ``x`` in ``block`` tiles."""
    return GluonDescriptor(x, list(x.shape), [x.stride(0), 1], list(block), smem_layout(block, x.dtype))
