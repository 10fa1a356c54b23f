"""The residual FP8 projection (o and down): x quantized in registers from its rows' amax, the FP8 GEMM, the
residual added in the epilogue; against its torch reference, on Triton's interpreter (CPU) and on the GPU. Also
the FP8 SwiGLU GEMM's row amax, which feeds it."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from rerankit.kernels import fp8_residual_matmul as residual  # noqa: E402
from rerankit.kernels import swiglu_matmul  # noqa: E402
from rerankit.kernels.fp8_quant import FP8_DTYPE, dequantize_rows, quantize_rows_reference  # noqa: E402
from test_fp8_kernels import assert_within_one_step, quantized  # noqa: E402
from triton_paths import forbid_reference  # noqa: E402

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def inputs(tokens, depth, width, seed, device="cpu", dtype=torch.float32):
    """x [T, d] with outlier channels, its row amax, a float8 weight [N, d] with scales, a residual [T, N]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, depth, generator=gen)
    x[:, :2] *= 20
    weight, w_scale = quantize_rows_reference(torch.randn(width, depth, generator=gen) / depth ** 0.5)
    hidden = torch.randn(tokens, width, generator=gen) * 4
    x, hidden = x.to(device, dtype), hidden.to(device, dtype)
    return x, residual.row_amax(x).float(), weight.to(device), w_scale.to(device), hidden


def test_reference_is_quantize_then_dequantized_product_plus_residual():
    x, amax, weight, w_scale, hidden = inputs(13, 64, 48, 0)
    bias = torch.randn(48)
    codes, scale = residual.quantize_with_amax_reference(x, amax)
    ref_codes, ref_scale = quantize_rows_reference(x)
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=0)
    assert_within_one_step(codes, ref_codes, 0.99)  # a reciprocal's multiplication for quantize_rows' division
    expected = hidden + dequantize_rows(codes, scale) @ dequantize_rows(weight, w_scale).T + bias
    got = residual.fp8_residual_matmul_reference(x, amax, weight, w_scale, hidden.clone(), bias)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_an_amax_below_the_rows_saturates_instead_of_overflowing():
    x, amax, weight, w_scale, hidden = inputs(4, 32, 16, 1)
    codes, _ = residual.quantize_with_amax_reference(x, amax / 4)
    assert codes.float().abs().max() == 448 and torch.isfinite(codes.float()).all()


def test_bad_shapes_name_the_argument():
    x, amax, weight, w_scale, hidden = inputs(5, 32, 16, 2)
    with pytest.raises(ValueError, match=r"hidden must be \[5, 16\], got \(5, 15\)"):
        residual.fp8_residual_matmul(x, amax, weight, w_scale, hidden[:, :15])
    with pytest.raises(ValueError, match=r"x_amax must be \[5\]"):
        residual.fp8_residual_matmul(x, amax[:4], weight, w_scale, hidden)
    with pytest.raises(ValueError, match="weight must be"):
        residual.fp8_residual_matmul(x, amax, weight.float(), w_scale, hidden)


@pytest.mark.parametrize("tokens, depth, width", [(37, 64, 48), (1, 32, 16), (70, 96, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_its_reference_in_the_interpreter(monkeypatch, tokens, depth, width, bias):
    """In-register quantization, FP8 dots, scales, bias and the residual add: within float32 summation order.
    float32 x and residual (the interpreter's bf16 cast truncates; the GPU test checks bf16)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the gpu test runs the kernel")
    x, amax, weight, w_scale, hidden = inputs(tokens, depth, width, tokens + depth)
    bias_values = torch.randn(width) if bias else None
    expected = residual.fp8_residual_matmul_reference(x, amax, weight, w_scale, hidden.clone(), bias_values)
    assert residual.takes_tma(x, weight, hidden)
    forbid_reference(monkeypatch, residual, "fp8_residual_matmul_reference")
    got = hidden.clone()
    assert residual.fp8_residual_matmul(x, amax, weight, w_scale, got, bias_values) is got
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_swiglu_gives_its_rows_amax(monkeypatch):
    """The FP8 SwiGLU GEMM's epilogue max-es each output row's max |value| into amax_out (the interpreter's
    kernel; other paths compute it after the fact), leaving larger values it held."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the gpu test runs the kernel")
    x, x_scale = quantized(37, 48, 3)
    weight, w_scale = quantize_rows_reference(torch.randn(96, 48) / 7)
    amax = torch.zeros(37)
    amax[0] = 1e6
    forbid_reference(monkeypatch, swiglu_matmul, "swiglu_matmul_reference")
    out = swiglu_matmul.swiglu_matmul(x, weight, x_scale=x_scale, w_scale=w_scale, out_dtype=torch.float32,
                                      amax_out=amax)
    expected = out.abs().amax(-1)
    expected[0] = 1e6
    torch.testing.assert_close(amax, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="amax_out goes with float8 inputs"):
        swiglu_matmul.swiglu_matmul(x.float(), weight.float(), amax_out=amax)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs Hopper's copy engine and FP8 tensor cores")
@pytest.mark.parametrize("depth, width", [(2048, 1024), (3072, 1024), (4096, 2560), (9728, 2560)],
                         ids=["0.6b-o", "0.6b-down", "4b-o", "4b-down"])
@pytest.mark.parametrize("tokens", [1, 777, 5000])
def test_gpu_kernel_follows_its_reference(depth, width, tokens):
    """Qwen3's o and down shapes in bf16: within a bf16 step of the residual (the reference rounds once too)."""
    x, amax, weight, w_scale, hidden = inputs(tokens, depth, width, tokens, "cuda", torch.bfloat16)
    assert residual.takes_tma(x, weight, hidden)
    expected = residual.fp8_residual_matmul_reference(x, amax, weight, w_scale, hidden.clone())
    got = residual.fp8_residual_matmul(x, amax, weight, w_scale, hidden.clone())
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs Hopper's copy engine and FP8 tensor cores")
def test_gpu_swiglu_amax_is_its_outputs():
    x, x_scale = quantized(5000, 1024, 4)
    weight, w_scale = quantize_rows_reference(torch.randn(6144, 1024) / 32)
    x, x_scale, weight, w_scale = (t.cuda() for t in (x, x_scale, weight, w_scale))
    amax = torch.zeros(5000, device="cuda")
    out = swiglu_matmul.swiglu_matmul(x, weight, x_scale=x_scale, w_scale=w_scale, amax_out=amax)
    assert out.dtype == torch.bfloat16 and x.dtype == FP8_DTYPE
    torch.testing.assert_close(amax, out.float().abs().amax(-1), atol=0, rtol=0)
