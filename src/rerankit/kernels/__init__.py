"""Triton kernels, one per module, each beside its plain-torch reference."""


def takes_head_dim(head_dim: int) -> bool:
    """Whether the attention and q/k kernels can tile a head of this size: they lay a head out with ``tl.arange``
    (a power of two) and feed it to ``tl.dot`` (K >= 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0
