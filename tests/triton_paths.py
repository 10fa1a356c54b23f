"""Tests that must run a Triton kernel, not its torch reference: skip where the kernel cannot run here, and make
the reference fail, so that a pass proves the kernel ran."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def forbid_reference(monkeypatch: pytest.MonkeyPatch, module: ModuleType, reference: str) -> None:
    """Skip unless ``module``'s kernel runs here (a GPU, or Triton's interpreter on the CPU); then make its torch
    fallback ``module.<reference>`` raise for the rest of the test."""
    if not torch.cuda.is_available() and not module._INTERPRET:
        pytest.skip("triton was imported without its interpreter")
    kernel = reference.removesuffix("_reference")

    def fallback_taken(*args, **kwargs):
        raise AssertionError(f"{kernel} fell back to the torch reference")

    monkeypatch.setattr(module, reference, fallback_taken)
