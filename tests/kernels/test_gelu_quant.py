"""The encoder's FP8 activation kernel (``kernels.gelu_quant``: bias, GELU, float8 codes under a bound a row) against
its torch reference, in Triton's interpreter on the CPU and on a GPU, and as one call inside a compiled step."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from rerankit.kernels import gelu_quant  # noqa: E402
from rerankit.kernels.fp8_quant import FP8_DTYPE  # noqa: E402
from triton_paths import forbid_reference  # noqa: E402

REFERENCE = gelu_quant.gelu_codes_reference
HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def inputs(rows: int, width: int, device: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    projected = (torch.randn(rows, width, generator=generator) * 3).to(torch.bfloat16)
    bias = (torch.randn(width, generator=generator) * 0.5).to(torch.bfloat16)
    lengths = torch.rand(rows, generator=generator) * 4 + 0.5
    lengths[0] = 0.0  # a row whose bound is GELU's least value
    up_bound = torch.tensor([2.0, float(bias.float().abs().max())])
    return [tensor.to(device) for tensor in (projected, bias, lengths, up_bound)]


def assert_matches(codes, scale, expected_codes, expected_scale, equal_share=0.0):
    """Scales exactly; codes to one e4m3 step, or a few subnormal steps (2^-7) where GELU's tail is near 0: there
    1 + erf(u / sqrt 2) cancels, and the interpreter's erf rounds apart from torch's. At least ``equal_share`` of the
    codes equal."""
    assert codes.dtype == FP8_DTYPE and codes.shape == expected_codes.shape
    torch.testing.assert_close(scale, expected_scale, atol=0, rtol=0)
    values, expected = codes.float(), expected_codes.float()
    assert ((values - expected).abs() <= expected.abs() * 2**-3 + 2**-7).all()
    assert (values == expected).float().mean() >= equal_share


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows,width", [(1, 16), (19, 300), (40, 512)])
def test_gelu_codes_kernel_follows_the_reference(monkeypatch, approximate, rows, width):
    projected, bias, lengths, up_bound = inputs(rows, width, "cpu" if not torch.cuda.is_available() else "cuda")
    expected = REFERENCE(projected, bias, lengths, up_bound, approximate)
    forbid_reference(monkeypatch, gelu_quant, "gelu_codes_reference")
    assert_matches(*gelu_quant.gelu_codes(projected, bias, lengths, up_bound, approximate), *expected)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
def test_gpu_gelu_codes_stay_one_call_in_a_compiled_step():
    """The Triton op traces whole (no graph break): Inductor launches the kernel from its own code, with the same
    result as the eager call. (On the CPU the interpreter cannot run under fake tensors.)"""
    projected, bias, lengths, up_bound = inputs(300, 512, "cuda")

    def step(projected, bias, lengths, up_bound):
        codes, scale = torch.ops.rerankit.gelu_codes(projected * 1.0, bias, lengths, up_bound, "none")
        return codes.float() * scale[:, None]

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(projected, bias, lengths, up_bound), step(projected, bias, lengths, up_bound),
                               atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
def test_gpu_gelu_codes_at_bert_large_width(monkeypatch):
    projected, bias, lengths, up_bound = inputs(5000, 4096, "cuda", seed=1)
    expected = REFERENCE(projected, bias, lengths, up_bound, "none")
    forbid_reference(monkeypatch, gelu_quant, "gelu_codes_reference")
    assert_matches(*gelu_quant.gelu_codes(projected, bias, lengths, up_bound, "none"), *expected, equal_share=0.999)
