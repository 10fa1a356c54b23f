"""FP8 inference: what ``dtype="fp8"`` asks for, which devices run it, and checkpoints whose weights are already FP8.

``dtype="fp8"`` quantizes the decoder's linear layers (q/k/v, o, gate/up, down; on models narrower than
RESIDUAL_FP8_MIN_HIDDEN q/k/v and gate/up only, see ``projections``) to float8_e4m3fn per output channel at load
time; activations are quantized per token before each of those GEMMs; everything else (embeddings, norms,
attention, the label head) runs in bf16 (``engine.models.fp8``). It needs FP8 tensor cores: compute
capability 8.9 on (Ada, Hopper, Blackwell). ``RERANKIT_FP8_REFERENCE=1`` runs the same numerics in plain torch on
any device instead (slow; for tests and fidelity checks on a CPU).

FP8 checkpoints: a ``config.json`` whose ``quantization_config`` is ``quant_method: "fp8"`` (float8 weights with
``weight_scale_inv``, per tensor or in ``weight_block_size`` blocks, as Qwen's and DeepSeek's FP8 releases) or
``compressed-tensors`` with float8 weights (``weight_scale`` per tensor or per channel). Their float8 weights and
scales are read as they are. Scales per block become per output channel (the kernels scale whole rows): such a
weight is dequantized and quantized again per channel, one more e4m3 rounding. Static activation scales
(``input_scale``) are ignored: activations are always scaled per token. Every runner gets the dequantized weights
(in the load dtype), so an FP8 checkpoint also runs in bf16 or float32.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from rerankit.errors import ModelLoadError
from rerankit.kernels.fp8_quant import FP8_DTYPE, dequantize_rows, quantize_rows_reference

FP8_NAMES = ("fp8", "float8", "float8_e4m3fn", "e4m3")
REFERENCE_ENV = "RERANKIT_FP8_REFERENCE"
PROJECTIONS_ENV = "RERANKIT_FP8_PROJECTIONS"
ALL_PROJECTIONS = ("qkv", "o", "gate_up", "down")
MIN_CAPABILITY = (8, 9)
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # quant_method "fp8"; compressed-tensors
SAFETENSORS_FP8 = "F8_E4M3"  # float8_e4m3fn's name in a safetensors header

Fp8Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (float8 codes [N, K], stored scales)


def is_fp8(dtype: str | torch.dtype | None) -> bool:
    """Whether ``dtype`` (as ``load_model`` takes it) asks for FP8."""
    if isinstance(dtype, torch.dtype):
        return dtype == FP8_DTYPE
    return isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in FP8_NAMES


def reference_mode() -> bool:
    """Whether $RERANKIT_FP8_REFERENCE=1: FP8's numerics in plain torch, on any device."""
    return os.environ.get(REFERENCE_ENV, "").strip() == "1"


# o and down in FP8 take their inputs quantized (the attention kernel and the SwiGLU GEMM write the codes), but their
# bf16 outputs are added by the next norm kernel, where bf16 GEMMs add into the residual stream in cuBLAS's
# epilogue. At hidden size 1,024 that leaves a gain of ~2% at most, for a larger deviation from float32: H100,
# 2026-11-27, `benchmarks/fp8_calls.py --shape 0.6b --docs 100 --rounds 5 --projections ...` (one process,
# alternating): q/k/v and gate/up 2,392 pairs/s, with down too 2,439, with o and down too 2,388, rounds spreading by
# 5%. At 2,560 (4B) they paid even with a quantization pass each (H100, 2026-11-25, 26.6k tokens: pass + FP8 GEMM
# + add 0.678 / 1.442 ms a layer for o / down, against 0.826 / 1.907 for bf16). Below this hidden size the default
# leaves them bf16.
RESIDUAL_FP8_MIN_HIDDEN = 2048


def projections(hidden_size: int) -> tuple[str, ...]:
    """The decoder projections ``dtype="fp8"`` quantizes: $RERANKIT_FP8_PROJECTIONS (comma-separated names of
    ALL_PROJECTIONS) where set; else all four from RESIDUAL_FP8_MIN_HIDDEN on, and q/k/v and gate/up below."""
    named = [name.strip() for name in os.environ.get(PROJECTIONS_ENV, "").split(",") if name.strip()]
    unknown = sorted(set(named) - set(ALL_PROJECTIONS))
    if unknown:
        raise ModelLoadError(f"${PROJECTIONS_ENV} names {unknown}; it takes a comma-separated list of "
                             f"{', '.join(ALL_PROJECTIONS)}")
    if named:
        return tuple(name for name in ALL_PROJECTIONS if name in named)
    return ALL_PROJECTIONS if hidden_size >= RESIDUAL_FP8_MIN_HIDDEN else ("qkv", "gate_up")


def device_lacks_fp8(device: torch.device) -> str | None:
    """Why ``device`` has no FP8 tensor cores, or None when it has them."""
    if device.type != "cuda":
        return f"{device} is not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}"
    return None


def check_device(device: torch.device) -> None:
    """``ModelLoadError`` unless ``device`` runs FP8 (or reference mode is on)."""
    reason = device_lacks_fp8(device)
    if reason is not None and not reference_mode():
        raise ModelLoadError(
            f"dtype 'fp8' needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper, "
            f"Blackwell), and {reason}; use dtype 'bfloat16' (GPU) or 'float32' (CPU), or set {REFERENCE_ENV}=1 to "
            "run FP8's numerics in plain torch (slow: tests and fidelity checks)")


def checkpoint_format(config: Any) -> str | None:
    """"fp8" or "compressed-tensors" for a checkpoint whose linear weights are stored as float8_e4m3fn; None for an
    unquantized one, or one quantized some other way (which stays transformers' business)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = settings.get("quant_method")
    if method == "fp8" and settings.get("fmt", "e4m3") == "e4m3":
        return "fp8"
    if method == "compressed-tensors":
        groups = settings.get("config_groups") or {}
        weights = [group.get("weights") or {} for group in groups.values()]
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
            return "compressed-tensors"
    return None


def without_quantization(config: Any) -> Any:
    """A copy of ``config`` without its ``quantization_config``, so that transformers builds a plain model."""
    plain = copy.deepcopy(config)
    if hasattr(plain, "quantization_config"):
        delattr(plain, "quantization_config")
    return plain


def _row_scales(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """float32 scales [N] of a weight stored with one scale or one per row ([N] or [N, 1]); None for block scales."""
    rows = codes.shape[0]
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows).contiguous()
    if scale.numel() == rows and (scale.dim() == 1 or scale.shape[-1] == 1):
        return scale.float().reshape(rows).contiguous()
    if scale.dim() != 2:
        raise ModelLoadError(f"a float8 weight {tuple(codes.shape)} has scales {tuple(scale.shape)}: neither per "
                             "tensor, per channel nor per block")
    return None


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 weight [N, K] of float8 ``codes`` times their scale: one, one per row, or one per block
    ([ceil(N / bn), ceil(K / bk)])."""
    rows, cols = codes.shape
    row_scales = _row_scales(codes, scale)
    if row_scales is not None:
        return dequantize_rows(codes, row_scales)
    block_rows, block_cols = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
    full = scale.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return codes.float() * full


def per_channel(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float32 scales [N]) as the FP8 kernels take them: the stored ones where the scale is per tensor or per
    row; a block-scaled weight dequantized and quantized again per row."""
    row_scales = _row_scales(codes, scale)
    return (codes, row_scales) if row_scales is not None else quantize_rows_reference(dequantize(codes, scale))


def read_fp8_weights(folder: Path, device: torch.device) -> Fp8Weights:
    """Every float8 ``<module>.weight`` of the safetensors files in ``folder`` with its scale, per channel."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} holds no .safetensors files to read FP8 weights from")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                # the float8 weights and their scales only: the checkpoint's 16-bit tensors are not read twice
                if name.endswith(SCALE_SUFFIXES) or (name.endswith(".weight")
                                                     and handle.get_slice(name).get_dtype() == SAFETENSORS_FP8):
                    tensors[name] = handle.get_tensor(name)
    weights: Fp8Weights = {}
    for name, codes in tensors.items():
        if not name.endswith(".weight") or codes.dtype != FP8_DTYPE:
            continue
        module = name.removesuffix(".weight")
        scale = next((tensors[module + suffix] for suffix in SCALE_SUFFIXES if module + suffix in tensors), None)
        if scale is None:
            raise ModelLoadError(f"the float8 weight {name} has no {' or '.join(SCALE_SUFFIXES)} beside it")
        _row_scales(codes, scale)  # checks the layout
        weights[module] = (codes, scale)
    if not weights:
        raise ModelLoadError(f"config.json says the weights in {folder} are FP8, but none of its tensors is float8")
    return weights


def load_dequantized(model: torch.nn.Module, weights: Fp8Weights) -> None:
    """Write each FP8 weight, dequantized, into ``model``'s module of that name (transformers loaded the float8
    codes cast to its dtype, without their scales)."""
    modules = dict(model.named_modules())
    missing = [name for name in weights if name not in modules]
    if missing:
        raise ModelLoadError(f"FP8 weights {missing[:3]} name no module of {type(model).__name__}")
    for name, (codes, scale) in weights.items():
        weight = modules[name].weight
        weight.data = dequantize(codes, scale).to(weight.dtype)
