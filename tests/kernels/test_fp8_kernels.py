"""FP8 kernels against their torch references: per-row quantization (alone and fused with the RMSNorm), the scaled
FP8 projection, and the FP8 paths of the SwiGLU and q/k/v GEMMs.

Small cases run the Triton kernels in Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1 there; it
loads, converts and multiplies float8_e4m3fn tiles); the `gpu` tests use the Qwen3 shapes on a GPU with FP8 tensor
cores (compute capability 8.9 on; the fused GEMMs need Hopper's copy engine).
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from rerankit.kernels import fp8_quant, qkv_rope_matmul, swiglu_matmul  # noqa: E402
from rerankit.kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference  # noqa: E402
from rerankit.kernels.fp8_quant import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    abs_max,
    abs_max_reference,
    dequantize_rows,
    quantize_bounded,
    quantize_bounded_reference,
    quantize_rows,
    quantize_rows_reference,
    rms_norm_quant,
    rms_norm_quant_reference,
)
from test_qkv_rope_matmul import make_inputs  # noqa: E402
from triton_paths import forbid_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def quantized(rows, width, seed, scale=1.0):
    """A float8 activation [rows, width] and its scales, from a bf16 tensor with a few large outliers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * scale
    x[:, :2] *= 20  # outlier channels, as real activations have
    return quantize_rows_reference(x.bfloat16())


def test_reference_round_trip_is_within_e4m3s_step():
    """Each row's largest magnitude maps to 448; dequantized values are within half an e4m3 step (2^-4 relative,
    3 mantissa bits) of the input; an all-zero row stays zero with a finite scale."""
    x = torch.randn(9, 200) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0
    codes, scale = quantize_rows_reference(x)
    assert codes.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (9,)
    amax = codes.float().abs().amax(dim=1)
    assert torch.equal(amax[[0, 1, 2, 3, 5, 6, 7, 8]], torch.full((8,), FP8_MAX))
    back = dequantize_rows(codes, scale)
    nonzero = x.abs() > scale[:, None] * 2 ** -6  # normal e4m3 codes (subnormals have coarser relative steps)
    assert ((back - x).abs()[nonzero] <= x.abs()[nonzero] * 2 ** -4).all()
    assert torch.isfinite(scale).all() and not back[4].any()


@pytest.mark.parametrize("rows, width", [(1, 64), (7, 96), (33, 48), (3, 1000), (0, 32)])
def test_quant_kernel_equals_the_reference(monkeypatch, rows, width):
    """The same codes and scales as the reference, bit for bit (bf16 input, as the decoder quantizes)."""
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(rows + width)) * 3).bfloat16()
    expected = quantize_rows_reference(x)
    forbid_reference(monkeypatch, fp8_quant, "quantize_rows_reference")
    codes, scale = quantize_rows(x.to(DEVICE))
    assert torch.equal(scale.cpu(), expected[1]) and torch.equal(codes.cpu().float(), expected[0].float())


@pytest.mark.parametrize("rows, width", [(1, 64), (37, 96), (300, 1000), (0, 32)])
def test_abs_max_kernel_reads_a_slice_of_columns_in_place_and_equals_the_reference(monkeypatch, rows, width):
    """The largest |v| of v, a slice of the q/k/v projection's columns (rows strided), alone and with a kept
    prefix's values, as the reference finds it; an empty tensor's is MIN_AMAX."""
    fused = (torch.randn(rows, 64 + width, generator=torch.Generator().manual_seed(rows)) * 3).bfloat16()
    v = fused[:, 64:].unflatten(1, (-1, 16) if width % 16 == 0 else (1, width))
    kept = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(1)).bfloat16() * 9  # kept prefix values
    expected, with_kept = abs_max_reference(v), abs_max_reference(v, kept)
    assert with_kept >= expected
    forbid_reference(monkeypatch, fp8_quant, "abs_max_reference")
    assert torch.equal(abs_max(v.to(DEVICE)).cpu(), expected)
    assert torch.equal(abs_max(v.to(DEVICE), kept.to(DEVICE)).cpu(), with_kept)


@pytest.mark.parametrize("rows, width", [(1, 64), (7, 96), (3, 1000), (0, 32)])
@pytest.mark.parametrize("loose", [1.0, 37.5])
def test_bounded_quant_kernel_equals_the_reference(monkeypatch, rows, width, loose):
    """One scale for every row, from a bound of |x| (exact, or far above it): the reference's codes and scales,
    bit for bit; the largest |x| maps to 448 under the exact bound."""
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(width)) * 3).bfloat16()
    bound = abs_max_reference(x) * loose
    expected = quantize_bounded_reference(x, bound)
    forbid_reference(monkeypatch, fp8_quant, "quantize_bounded_reference")
    codes, scale = quantize_bounded(x.to(DEVICE), bound.to(DEVICE))
    assert torch.equal(scale.cpu(), expected[1]) and torch.equal(codes.cpu().float(), expected[0].float())
    assert scale.shape == (rows,) and (rows == 0 or torch.equal(scale.cpu(), (bound / FP8_MAX).expand(rows)))
    if rows and loose == 1.0:
        assert codes.float().abs().max() == FP8_MAX


@pytest.mark.parametrize("rows, width", [(1, 64), (7, 96), (3, 1000)])
def test_fused_norm_quant_kernel_quantizes_the_norm_kernels_rows(rows, width):
    """rms_norm_quant's codes are those of ``rms_norm``'s bf16 rows (the fused norm rounds as the norm kernel does),
    and within one e4m3 step of the reference's (the interpreter's bf16 cast truncates, so the rows themselves may
    differ from torch's in the last bit)."""
    from rerankit.kernels.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16().to(DEVICE)
    weight = (torch.rand(width, generator=gen) + 0.5).bfloat16().to(DEVICE)
    codes, scale = rms_norm_quant(x, weight, 1e-6)
    norm_codes, norm_scale = quantize_rows(rms_norm(x, weight, 1e-6))
    assert torch.equal(scale, norm_scale) and torch.equal(codes.float(), norm_codes.float())
    assert_within_one_step(codes, rms_norm_quant_reference(x, weight, 1e-6)[0])


@pytest.mark.parametrize("rows, width", [(5, 64), (33, 1024)])
def test_add_norm_quant_kernel_adds_in_place_then_quantizes_the_norm(monkeypatch, rows, width):
    """The residual add folded into the norm's kernel: x becomes x + delta (in place), and the codes and scales are
    those of rms_norm_quant on the sum. float32 on the CPU (the interpreter's bf16 cast truncates; the GPU test
    checks bf16)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=gen).to(DEVICE)
    delta = torch.randn(rows, width, generator=gen).to(DEVICE)
    norm = (torch.rand(width, generator=gen) + 0.5).to(DEVICE)
    expected_x = x + delta
    expected = fp8_quant.rms_norm_quant_reference(expected_x, norm, 1e-6)
    if DEVICE == "cpu":
        forbid_reference(monkeypatch, fp8_quant, "add_rms_norm_quant_reference")
    got = fp8_quant.add_rms_norm_quant(x, delta, norm, 1e-6)
    torch.testing.assert_close(x, expected_x, atol=0, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=1e-6)
    assert_within_one_step(got[0], expected[0], 0.99)
    with pytest.raises(ValueError, match=r"x and delta \[T, d\] and weight \[d\]"):
        fp8_quant.add_rms_norm_quant(x, delta[:, :8], norm, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
def test_gpu_add_norm_quant_rounds_the_sum_as_torch_does():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(777, 2560, device="cuda", generator=gen).bfloat16()
    delta = torch.randn(777, 2560, device="cuda", generator=gen).bfloat16()
    norm = (torch.rand(2560, device="cuda", generator=gen) + 0.5).bfloat16()
    expected_x = x + delta
    expected = rms_norm_quant(expected_x.clone(), norm, 1e-6)
    got = fp8_quant.add_rms_norm_quant(x, delta, norm, 1e-6)
    torch.testing.assert_close(x, expected_x, atol=0, rtol=0)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))


@pytest.mark.parametrize("rows, width", [(1, 64), (7, 96), (3, 1000), (0, 32)])
@pytest.mark.parametrize("add", [False, True])
def test_norm_quant_kernels_give_the_quantized_rows_squared_lengths(monkeypatch, rows, width, add):
    """``sumsq=True``: the codes and scales as without it, and each row's squared length after quantization,
    scale^2 * sum(codes^2), within float32 summation order of the reference's."""
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(DEVICE)
    delta = torch.randn(rows, width, generator=gen).to(DEVICE) if add else None
    norm = (torch.rand(width, generator=gen) + 0.5).to(DEVICE)
    reference = "add_rms_norm_quant_reference" if add else "rms_norm_quant_reference"
    if DEVICE == "cpu":
        forbid_reference(monkeypatch, fp8_quant, reference)
    if add:
        codes, scale, lengths = fp8_quant.add_rms_norm_quant(x.clone(), delta, norm, 1e-6, sumsq=True)
        plain = fp8_quant.add_rms_norm_quant(x.clone(), delta, norm, 1e-6)
    else:
        codes, scale, lengths = rms_norm_quant(x, norm, 1e-6, sumsq=True)
        plain = rms_norm_quant(x, norm, 1e-6)
    assert torch.equal(scale, plain[1]) and torch.equal(codes.float(), plain[0].float())
    assert lengths.shape == (rows,) and lengths.dtype == torch.float32
    torch.testing.assert_close(lengths, fp8_quant.squared_lengths(codes, scale), atol=0, rtol=1e-5)
    torch.testing.assert_close(lengths, dequantize_rows(codes, scale).square().sum(-1), atol=0, rtol=1e-5)


def swiglu_fp8_inputs(tokens, hidden, width, seed, device=DEVICE):
    """Float8 x (a normed activation, with its squared lengths) and gate/up weight [2 * width, hidden]."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).bfloat16()
    norm = (torch.rand(hidden, generator=gen) + 0.5).bfloat16()
    codes, scale, lengths = rms_norm_quant_reference(x, norm, 1e-6, sumsq=True)
    weight, w_scale = quantize_rows_reference(torch.randn(2 * width, hidden, generator=gen) / hidden ** 0.5)
    return [t.to(device) for t in (codes, scale, lengths, weight, w_scale)]


@pytest.mark.parametrize("tokens, hidden, width", [(37, 48, 48), (1, 32, 16), (20, 64, 80)])
def test_swiglu_fp8_out_kernel_equals_its_reference(monkeypatch, tokens, hidden, width):
    """The SwiGLU GEMM's float8 output: the reference's codes within one e4m3 step, most of them equal (the
    interpreter's bf16 cast truncates the gate and up projections where torch rounds them; summation order), and
    the same scales bit for bit; the codes stand for the float32 products within an e4m3 step of each, or a
    subnormal step of the row's scale."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the gpu tests run the FP8 GEMMs")
    codes, scale, lengths, weight, w_scale = swiglu_fp8_inputs(tokens, hidden, width, tokens + hidden)
    bound = swiglu_matmul.swiglu_bound(weight, w_scale)
    expected = swiglu_matmul.swiglu_matmul_fp8_out_reference(codes, weight, scale, w_scale, lengths, bound)
    values = swiglu_matmul.swiglu_matmul_reference(codes, weight, x_scale=scale, w_scale=w_scale,
                                                   out_dtype=torch.float32)
    forbid_reference(monkeypatch, swiglu_matmul, "swiglu_matmul_fp8_out_reference")
    got_codes, got_scale = swiglu_matmul.swiglu_matmul_fp8_out(codes, weight, scale, w_scale, lengths, bound)
    assert got_codes.dtype == FP8_DTYPE and got_codes.shape == (tokens, width)
    assert torch.equal(got_scale, expected[1])
    assert torch.equal(got_scale, (lengths * torch.tensor(bound)).clamp(min=fp8_quant.MIN_AMAX) / FP8_MAX)
    assert_within_one_step(got_codes, expected[0], 0.85)
    back = dequantize_rows(got_codes, got_scale)
    assert ((back - values).abs() <= values.abs() * 2 ** -3 + got_scale[:, None] * 2 ** -9).all()


def test_swiglu_bound_holds_where_x_lies_along_a_gate_and_an_up_row():
    """Cauchy-Schwarz is tight where x is parallel to the gate and the up row of a column: that column's product
    reaches the bound (silu(g) ~ g for a large positive g), and its code stands for it within e4m3's rounding: no
    clipping at 448."""
    hidden, width = 64, 32
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(2 * width, hidden, generator=gen) / hidden ** 0.5
    weight[width + 5] = weight[5] * 1.5  # column 5: up row along the gate row
    weight, w_scale = quantize_rows_reference(weight)
    row = dequantize_rows(weight[5:6], w_scale[5:6])[0]
    x = torch.stack([row * 40, -row * 40, torch.randn(hidden, generator=gen)])
    codes, scale, lengths = quantize_rows_reference(x) + (None,)
    lengths = fp8_quant.squared_lengths(codes, scale)
    bound = swiglu_matmul.swiglu_bound(weight, w_scale)
    got_codes, got_scale = swiglu_matmul.swiglu_matmul_fp8_out_reference(codes, weight, scale, w_scale, lengths,
                                                                         bound)
    values = swiglu_matmul.swiglu_matmul_reference(codes, weight, x_scale=scale, w_scale=w_scale,
                                                   out_dtype=torch.float32)
    assert (values.abs().amax(-1) <= lengths * bound * 1.01).all()
    assert got_codes.float().abs()[0, 5] > 0.9 * FP8_MAX
    back = dequantize_rows(got_codes, got_scale)
    assert ((back - values).abs() <= values.abs() * 2 ** -4 + got_scale[:, None] * 2 ** -10).all()
    torch.testing.assert_close(back[0, 5], values[0, 5], atol=0, rtol=2 ** -4)


def assert_within_one_step(codes, expected, equal_share=0.8):
    """Codes at most one e4m3 step (2^-3 of the value) from the expected ones, most of them equal."""
    steps = (codes.float() - expected.float()).abs() / expected.float().abs().clamp(min=2 ** -6)
    assert steps.max() <= 2 ** -3 and (codes.float() == expected.float()).float().mean() >= equal_share


def test_fp8_matmul_reference_is_the_dequantized_product():
    x, x_scale = quantized(13, 64, 0)
    weight, w_scale = quantize_rows_reference(torch.randn(48, 64) / 8)
    bias = torch.randn(48)
    expected = (dequantize_rows(x, x_scale) @ dequantize_rows(weight, w_scale).T + bias).bfloat16()
    got = fp8_matmul_reference(x, x_scale, weight, w_scale, bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(fp8_matmul(x, x_scale, weight, w_scale, bias), got)  # CPU: the reference
    with pytest.raises(ValueError, match=r"w_scale \[48\], got \(13,\) and \(5,\)"):
        fp8_matmul_reference(x, x_scale, weight, w_scale[:5])


@pytest.fixture(params=["swiglu", "qkv_rope"])
def fp8_gemm(request, monkeypatch):
    """(kernel module, the reference's name): the fused GEMM on its Triton path, on the CPU's interpreter."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the gpu tests run the FP8 GEMMs")
    module = swiglu_matmul if request.param == "swiglu" else qkv_rope_matmul
    name = "swiglu_matmul_reference" if request.param == "swiglu" else "qkv_rope_matmul_reference"
    return module, name, monkeypatch


@pytest.mark.parametrize("tokens, hidden", [(37, 48), (1, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemm_kernels_equal_their_references(fp8_gemm, tokens, hidden, bias):
    """FP8 tiles into tl.dot, the scales in the epilogue: within float32 summation order of the reference, which
    dequantizes in float32 (a row tail; float8 rows of 16-byte multiples leave no K or column tails). Output in
    float32: the interpreter's bf16 cast truncates (the GPU tests check bf16 outputs)."""
    module, name, monkeypatch = fp8_gemm
    x, x_scale = quantized(tokens, hidden, tokens)
    gen = torch.Generator().manual_seed(hidden)
    if module is swiglu_matmul:
        weight, w_scale = quantize_rows_reference(torch.randn(2 * 48, hidden, generator=gen) / hidden ** 0.5)
        bias_values = torch.randn(96, generator=gen).bfloat16() if bias else None
        args, kwargs = (x, weight, bias_values), dict(x_scale=x_scale, w_scale=w_scale, out_dtype=torch.float32)
        expected = module.swiglu_matmul_reference(*args, **kwargs)
        run = module.swiglu_matmul
    else:
        inputs, _, _ = make_inputs(tokens, hidden, 2, 1, 16, not bias, bias)
        weight, w_scale = quantize_rows_reference(inputs["weight"])
        bias_values = inputs["bias"].bfloat16() if bias else None
        inputs = {**inputs, "x": x, "weight": weight, "bias": bias_values}
        kwargs = dict(num_heads=2, num_kv_heads=1, head_dim=16, x_scale=x_scale, w_scale=w_scale,
                      out_dtype=torch.float32)
        args = ()
        expected = module.qkv_rope_matmul_reference(**inputs, **kwargs)
        run = lambda **kw: module.qkv_rope_matmul(**inputs, **kw)  # noqa: E731
    forbid_reference(monkeypatch, module, name)
    got = run(*args, **kwargs)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fp8_inputs_need_their_scales():
    x, x_scale = quantized(4, 32, 1)
    weight, w_scale = quantize_rows_reference(torch.randn(64, 32))
    with pytest.raises(ValueError, match="take x_scale and w_scale"):
        swiglu_matmul.swiglu_matmul(x, weight)
    with pytest.raises(ValueError, match="take x_scale and w_scale"):
        swiglu_matmul.swiglu_matmul(x.float(), weight.float(), x_scale=x_scale, w_scale=w_scale)
    with pytest.raises(ValueError, match="descriptors only"):
        swiglu_matmul.swiglu_matmul(x, weight, tma=False, x_scale=x_scale, w_scale=w_scale)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("shape", [(1024, 3072), (2560, 9728)], ids=["0.6b", "4b"])
@pytest.mark.parametrize("tokens", [1, 777, 5000])
def test_gpu_fp8_gemms_follow_their_references(shape, tokens):
    """Qwen3 shapes on the GPU: quantization (Triton), cuBLAS's scaled GEMM and the fused FP8 SwiGLU GEMM against
    the float32-dequantizing references, within a bf16 rounding or two."""
    hidden, width = shape
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    norm = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    codes, scale = rms_norm_quant(x, norm, 1e-6)
    ref_codes, ref_scale = rms_norm_quant_reference(x, norm, 1e-6)
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=1e-6)
    assert_within_one_step(codes, ref_codes, 0.99)  # float32 division and bf16 sums may differ in the last bit
    weight, w_scale = quantize_rows_reference((torch.randn(2 * width, hidden, device="cuda", generator=gen)
                                               / hidden ** 0.5).bfloat16())
    for got, expected in (
            (fp8_matmul(codes, scale, weight, w_scale), fp8_matmul_reference(codes, scale, weight, w_scale)),
            (swiglu_matmul.swiglu_matmul(codes, weight, x_scale=scale, w_scale=w_scale),
             swiglu_matmul.swiglu_matmul_reference(codes, weight, x_scale=scale, w_scale=w_scale))):
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # float8 output for the down projection: the codes stand for the products within half an e4m3 step of each
    # (3 mantissa bits) or of the row's scale (subnormals), beside the GEMM's own deviation allowed above
    lengths = fp8_quant.squared_lengths(codes, scale)
    bound = swiglu_matmul.swiglu_bound(weight, w_scale)
    if HAS_HOPPER:
        assert swiglu_matmul.takes_tma(codes, weight)
    got_codes, got_scale = swiglu_matmul.swiglu_matmul_fp8_out(codes, weight, scale, w_scale, lengths, bound)
    expected_codes, expected_scale = swiglu_matmul.swiglu_matmul_fp8_out_reference(codes, weight, scale, w_scale,
                                                                                   lengths, bound)
    torch.testing.assert_close(got_scale, expected_scale, atol=0, rtol=0)
    values = swiglu_matmul.swiglu_matmul_reference(codes, weight, x_scale=scale, w_scale=w_scale,
                                                   out_dtype=torch.float32)
    back = dequantize_rows(got_codes, got_scale)
    allowed = values.abs() * (2 ** -4 + 2e-2) + got_scale[:, None] * 2 ** -10 + 2e-2
    assert ((back - values).abs() <= allowed).all()
    assert (got_codes.float() == expected_codes.float()).float().mean() >= 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("hidden", [1024, 2560], ids=["0.6b", "4b"])
@pytest.mark.parametrize("tokens", [1, 777, 5000])
@pytest.mark.xfail(strict=False, reason="H100, 2026-11-25: at 777 and 5,000 tokens the FP8 q/k/v kernel differed "
                   "from its float32-accumulating reference by up to 0.0625 (a bf16 step at 8-16) after the q/k norm; "
                   "whether it is the tensor cores' FP8 accumulation (max_num_imprecise_acc) is not settled")
def test_gpu_fp8_qkv_rope_gemm_follows_its_reference(hidden, tokens):
    """The fused FP8 q/k/v GEMM (q/k norm and rotary in its epilogue) against its float32-dequantizing reference."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    norm = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    codes, scale = rms_norm_quant(x, norm, 1e-6)
    inputs, _, _ = make_inputs(tokens, hidden, 16, 8, 128, True, False, dtype=torch.bfloat16, device="cuda")
    qkv_weight, qkv_scale = quantize_rows_reference(inputs["weight"])
    inputs = {**inputs, "x": codes, "weight": qkv_weight}
    kwargs = dict(num_heads=16, num_kv_heads=8, head_dim=128, x_scale=scale, w_scale=qkv_scale)
    if HAS_HOPPER:
        assert qkv_rope_matmul.takes_tma(codes, qkv_weight, 128)
    torch.testing.assert_close(qkv_rope_matmul.qkv_rope_matmul(**inputs, **kwargs).float(),
                               qkv_rope_matmul.qkv_rope_matmul_reference(**inputs, **kwargs).float(),
                               atol=2e-2, rtol=2 ** -7)

