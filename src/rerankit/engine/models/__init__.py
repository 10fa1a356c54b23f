"""Our own packed forward for the main model families, built on an already-loaded transformers model.

``build_packed_model`` shares the transformers model's weight tensors; it does not copy them. The only
new tensors are the fused q/k/v and gate/up matrices, and the transformers projections are re-pointed
at slices of those, so the weights stay in memory once and the transformers model still runs (the
fallback path) on the same storage.
"""

from __future__ import annotations

import torch
from torch import nn

from rerankit.engine.models import decoder, encoder
from rerankit.engine.models.decoder import PackedDecoder
from rerankit.engine.models.encoder import PackedEncoder
from rerankit.errors import ModelLoadError

__all__ = ["PackedDecoder", "PackedEncoder", "build_packed_model", "supports", "unsupported_reason"]


def supports(config) -> bool:
    """True when a packed model exists for this transformers config."""
    return decoder.unsupported_reason(config) is None or encoder.unsupported_reason(config) is None


def unsupported_reason(config, device: torch.device) -> str | None:
    """Why the packed forward cannot run ``config`` on ``device`` (no packed model for it, or on CUDA a head size
    the attention kernel does not take), or None when it can. ``make_runner`` decides by this, and ``load_model``
    (which then reads an encoder's tensors without building the transformers model)."""
    from rerankit.kernels import takes_head_dim

    if not supports(config):
        name = (getattr(config, "architectures", None) or ["this model"])[0]
        return f"there is no packed forward for {name} (model_type {config.model_type!r})"
    head_dim = config.hidden_size // config.num_attention_heads
    if decoder.unsupported_reason(config) is None:
        head_dim = getattr(config, "head_dim", None) or head_dim  # as PackedDecoder reads it
    if device.type == "cuda" and not takes_head_dim(head_dim):
        return f"the packed attention kernel needs a head size that is a power of two >= 16, not {head_dim}"
    return None


def build_packed_model(hf_model: nn.Module, compile: bool | None = None, attention_fn=None, fp8: bool = False,
                       fp8_weights: dict | None = None) -> PackedDecoder | PackedEncoder | None:
    """A packed model over ``hf_model``'s weights (CausalLM, SequenceClassification or base model).

    None for an architecture we do not run, so the caller falls back to the transformers model.
    ``compile`` None: torch.compile the per-layer math on CUDA only (see ``layers.layer_steps``). ``fp8``,
    ``fp8_weights``: FP8 projections (see ``PackedDecoder`` and ``PackedEncoder``).
    """
    config = hf_model.config
    if decoder.unsupported_reason(config) is None:
        return PackedDecoder(hf_model, compile=compile, attention_fn=attention_fn, fp8=fp8, fp8_weights=fp8_weights)
    if encoder.unsupported_reason(config) is None:
        return PackedEncoder(hf_model, compile=compile, attention_fn=attention_fn, fp8=fp8, fp8_weights=fp8_weights)
    if fp8:
        raise ModelLoadError(f"dtype 'fp8' runs the packed decoders ({', '.join(decoder.MODEL_TYPES)}) and encoders "
                             f"({', '.join(encoder.MODEL_TYPES)}) only, not {config.model_type!r}; use dtype "
                             "'bfloat16'")
    return None
