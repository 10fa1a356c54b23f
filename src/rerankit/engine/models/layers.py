"""Math shared by the packed models: norms, rotary embedding, feed-forward blocks, weight fusion.

Everything here works on packed activations ``[T, ...]`` (no batch axis) and is plain torch, so the
per-layer step functions that call it can be handed to ``torch.compile`` unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rerankit.engine.batch import PackedBatch
from rerankit.engine.prefix_cache import CachedKV

ROPE_TYPES = ("default", "llama3")
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama/Qwen compute it: statistics in float32, the scale applied in the input dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_parameters(config) -> dict:
    """The config's rotary parameters as one dict (transformers 5 ``rope_parameters`` or the older fields)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_unsupported_reason(config) -> str | None:
    """Why this config's rotary embedding cannot be computed here, or None when it can."""
    params = rope_parameters(config)
    if "rope_theta" not in params:
        return "rope parameters are given per layer type"
    if params["rope_type"] not in ROPE_TYPES:
        return f"rope_type {params['rope_type']!r} (supported: {', '.join(ROPE_TYPES)})"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embedding"
    return None


def rope_inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    """Float32 inverse frequencies [head_dim/2], with Llama 3 frequency scaling when the config asks for it."""
    reason = rope_unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"unsupported rotary embedding: {reason}")
    params = rope_parameters(config)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if params["rope_type"] == "llama3":
        inv_freq = _llama3_scaled(inv_freq, params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between interpolated.
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for each token's position, computed in float32 then cast to ``dtype``."""
    freqs = position_ids.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, D] query or key heads by per-token angles (the half-split layout of Llama/Qwen)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def swiglu(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
           down_weight: torch.Tensor, down_bias: torch.Tensor | None, opaque_down: bool = False) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul; ``opaque_down``: the down projection
    through ``residual_projection``."""
    gate, up = F.linear(x, gate_up_weight, gate_up_bias).chunk(2, dim=-1)
    down = residual_projection if opaque_down else F.linear
    return down(F.silu(gate) * up, down_weight, down_bias)


@torch.library.custom_op("rerankit::residual_projection", mutates_args=())
def residual_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` as an op that ``torch.compile`` cannot see into, for a projection whose output is added to the
    residual stream.

    Inductor rewrites ``hidden + x @ W.T`` into ``addmm(hidden, x, W.T)``, which first copies ``hidden`` into the
    output (a device-to-device copy per projection, two per layer) and then runs the GEMM variant that reads it
    back. Behind this op the GEMM writes its own output and the add fuses into the next norm's kernel instead.
    """
    return F.linear(x, weight, bias)


@residual_projection.register_fake
def _residual_projection_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def fuse_rows(params: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Concatenate weights (or biases) along the output dimension without keeping a second copy.

    Each source parameter is re-pointed at its slice of the fused tensor, so the transformers module it
    belongs to keeps working and its old storage is freed. None when every source is None (no bias).
    """
    if all(param is None for param in params):
        return None
    if any(param is None for param in params):
        raise ValueError("cannot fuse projections where only some have a bias")
    fused = torch.cat([param.detach() for param in params], dim=0)
    start = 0
    for param in params:
        rows = param.shape[0]
        param.data = fused[start:start + rows]
        start += rows
    return fused


def default_attention():
    """``rerankit.engine.attention.packed_attention``, imported at first use so importing a model stays light."""
    from rerankit.engine.attention import packed_attention

    return packed_attention


def takes_reads(attention: Callable) -> bool:
    """Whether ``attention`` is ``packed_attention`` (perhaps with its backend bound), which takes ``reads=`` and
    ``fp8_bound=``."""
    from rerankit.engine.attention import packed_attention

    return attention is packed_attention or (isinstance(attention, functools.partial)
                                             and attention.func is packed_attention)


def layer_steps(*steps: Callable, compile: bool | None, device: torch.device) -> tuple[Callable, ...]:
    """The per-layer step functions, through ``torch.compile`` when asked; by default on CUDA only.

    On an H100 (benchmarks/forward.py, W1 pack, Qwen3-0.6B body) compiled steps ran in 79 ms against 200 ms
    eager: fused norms, rotary and activations. On CPU compiling was slower than eager.
    """
    if compile is None:
        compile = device.type == "cuda"
    return tuple(torch.compile(step, dynamic=True) if compile else step for step in steps)


class PackedBody(nn.Module):
    """A packed model body: ``_run(batch, read_positions, graphed)`` gives the final hidden states of every token,
    or with read positions only those rows (the last layer runs on them alone).

    ``graphed``: the forward is being captured into a CUDA graph (``engine.graphs``), so its host launches cost
    nothing at replay and a model picks the steps that take the least GPU time at any batch size.
    """

    @torch.no_grad()
    def forward(self, batch: PackedBatch, graphed: bool = False, cached_kv: CachedKV | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of every packed token. ``cached_kv``: the keys and values of
        ``batch.cached_head`` (``engine.prefix_cache``), when the batch has one."""
        return self._run(batch, None, graphed, cached_kv)

    @torch.no_grad()
    def forward_read(self, batch: PackedBatch, graphed: bool = False,
                     cached_kv: CachedKV | None = None) -> torch.Tensor:
        """Final hidden states [N, hidden] at ``batch.read_positions`` only (in their order)."""
        return self._run(batch, batch.read_positions, graphed, cached_kv)

    def _run(self, batch: PackedBatch, read_positions: torch.Tensor | None, graphed: bool,
             cached_kv: CachedKV | None = None) -> torch.Tensor:
        raise NotImplementedError
