"""What the warp-specialized FP8 GEMMs in Gluon (``qkv_rope_ws``, ``swiglu_ws``) share: Triton's Gluon Hopper ops
(``gluon`` is None where this triton lacks them), the grouped tile order, the tensor descriptors of their 2-D
operands, and the checks every call must pass before either kernel takes it."""

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


@functools.lru_cache(maxsize=16)
def smem_layout(block: tuple[int, int], dtype: torch.dtype):
    """The swizzled shared-memory layout of a ``block`` tile, computed once (host time a launch otherwise)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv if dtype == FP8_DTYPE else gl.bfloat16)


def descriptor(x: torch.Tensor, block: tuple[int, int]):
    """A tensor descriptor of the 2-D row-major ``x`` in ``block`` tiles."""
    return GluonDescriptor(x, list(x.shape), [x.stride(0), 1], list(block), smem_layout(block, x.dtype))
