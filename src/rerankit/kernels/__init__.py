"""Triton kernels, one per module, each beside its plain-torch reference."""

import functools
import logging
import threading

import torch


def takes_head_dim(head_dim: int) -> bool:
    """Whether the attention and q/k kernels can tile a head of this size: they lay a head out with ``tl.arange``
    (a power of two) and feed it to ``tl.dot`` (K >= 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def rows_take_tma(*tensors: torch.Tensor) -> bool:
    """Whether each [T, H, D] tensor is the 2-D [T, H * D] rows a tensor descriptor (Hopper's copy engine) reads:
    each token's heads side by side, as the q/k/v projection lays them out, with 16-byte row strides and a 16-byte
    aligned start."""
    return all(x.stride(2) == 1 and x.stride(1) == x.shape[2] and (x.stride(0) * x.element_size()) % 16 == 0
               and x.data_ptr() % 16 == 0 for x in tensors)


@functools.cache
def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of CUDA ``device``, asked once (torch asks the driver on every call)."""
    return torch.cuda.get_device_capability(device)


@functools.cache
def sm_count(device: torch.device, interpreted: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (how many programs fill it); ``interpreted`` stands in for
    them on the CPU (Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else interpreted


# The GEMMs are tuned per bucket of token counts: a tile and pipeline depth that suit 26k tokens (W1's micro-batch:
# hundreds of tiles a program) are not those that suit 2k (a tile or two a program), and a config tuned at the first
# call's size (a server's warm-up starts small) used to serve every size after it.
MIN_TUNED_TOKENS = 2048  # below: one bucket (launch-bound sizes)
MAX_TUNED_TOKENS = 65536  # above: one bucket (hundreds of tiles a program either way)


def token_bucket(tokens: int) -> int:
    """The tuning bucket of a GEMM over ``tokens`` rows: the power of two at or above it, from MIN_TUNED_TOKENS to
    MAX_TUNED_TOKENS."""
    return min(MAX_TUNED_TOKENS, max(MIN_TUNED_TOKENS, 1 << max(tokens - 1, 1).bit_length()))


_TUNED: dict = {}  # (autotuner, key) -> the config its tuning chose
_TUNING = threading.Lock()  # a tuner's best_config is the last launch's: read it before another thread launches


def launch_tuned(kernel, key: tuple, grid, args: tuple, kwargs: dict, set_block_shapes,
                 tokens: int | None = None) -> None:
    """Launch ``triton.autotune``'d ``kernel`` on ``args``/``kwargs``: through its tuner the first time for ``key``
    (which must determine the tuner's own key, or be finer: given ``tokens``, the GEMM's rows, a tuner keyed on
    ``M`` tunes once per ``token_bucket``, at the bucket's first size), then straight through the compiled function with the
    config the tuner chose, by ``direct_launch.launch``. The tuner rebuilds dicts of every argument and runs the
    config's pre-hook on each call, ~35-70 us of host time a launch on an H100 host, where an eager LI forward's
    launches can take longer than the GPU. ``set_block_shapes(config)`` does the pre-hook's work (the descriptors'
    block shapes) for a direct launch."""
    if tokens is not None:
        key = (*key, token_bucket(tokens))
    config = _TUNED.get((id(kernel), key))
    if config is None:
        from rerankit.kernels.direct_launch import note_launch_elsewhere

        note_launch_elsewhere()
        with _TUNING:
            kernel[grid](*args, **kwargs)
            _TUNED[(id(kernel), key)] = kernel.best_config
        return
    from rerankit.kernels.direct_launch import launch  # triton's import: not at this package's

    set_block_shapes(config)
    launch(kernel.fn, grid, *args, **kwargs, **config.all_kwargs())


_GLUON_BROKEN: set[str] = set()  # Gluon kernels that failed to compile on this triton


def run_gluon(name: str, launch):
    """``launch()`` (a Gluon kernel's call), or None where it does not compile on this triton: Gluon's API moves
    between releases (``gl.warp_specialize`` took other arguments before Triton 3.6), and a fast path that cannot
    compile must not fail a call the Triton kernel can run. The first failure is logged and the kernel is not tried
    again in this process; the caller then runs its Triton kernel."""
    if name in _GLUON_BROKEN:
        return None
    try:
        return launch()
    except Exception as error:  # the exception types are looked up only when one is raised (no imports a call)
        import triton
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        if not isinstance(error, (CompilationError, OutOfResources)):
            raise
        _GLUON_BROKEN.add(name)
        cause = error.__cause__ or error
        logging.getLogger("rerankit.engine").warning(
            "the %s kernel (Gluon) does not compile on triton %s, its Triton kernel runs instead: %s", name,
            triton.__version__, f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1][:300]}")
        return None
