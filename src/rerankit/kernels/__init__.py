"""Triton kernels, one per module, each beside its plain-torch reference."""
