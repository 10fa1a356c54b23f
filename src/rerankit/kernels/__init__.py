"""Triton kernels, one per module, each beside its plain-torch reference."""

import functools

import torch


def takes_head_dim(head_dim: int) -> bool:
    """Whether the attention and q/k kernels can tile a head of this size: they lay a head out with ``tl.arange``
    (a power of two) and feed it to ``tl.dot`` (K >= 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@functools.cache
def sm_count(device: torch.device, interpreted: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (how many programs fill it); ``interpreted`` stands in for
    them on the CPU (Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else interpreted
