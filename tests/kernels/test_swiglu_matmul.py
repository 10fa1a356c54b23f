"""swiglu_matmul: the Triton kernel (gate/up GEMM with SwiGLU in its epilogue) against the torch reference.

Small cases run the kernel in Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1 there), compiled
where a GPU is present; the `gpu` test uses the Qwen3-0.6B MLP shape in bf16.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from rerankit.kernels import swiglu_matmul as kernels  # noqa: E402
from rerankit.kernels.swiglu_matmul import swiglu_matmul_reference  # noqa: E402
from triton_paths import forbid_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_swiglu_matmul(monkeypatch):
    """`swiglu_matmul` on the Triton path (its torch fallback fails), inputs and outputs on the CPU."""
    forbid_reference(monkeypatch, kernels, "swiglu_matmul_reference")

    def run(x, weight, bias=None, tma=None):
        moved = bias.to(DEVICE) if bias is not None else None
        return kernels.swiglu_matmul(x.to(DEVICE), weight.to(DEVICE), moved, tma=tma).cpu()

    return run


@pytest.mark.parametrize("tokens, width, hidden", [(37, 24, 40), (1, 16, 16), (50, 48, 80), (0, 16, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_kernel_equals_the_reference(triton_swiglu_matmul, tokens, width, hidden, with_bias, tma):
    """Tails on every axis (rows, columns and K not multiples of the 16-wide tiles), one row, no rows, biases; both
    the pointer and the tensor-descriptor kernels."""
    if tma and DEVICE == "cuda":
        pytest.skip("on a GPU the descriptor kernel takes 16-bit inputs (the gpu tests run it)")
    generator = torch.Generator().manual_seed(tokens + width + hidden)
    x = torch.randn(tokens, hidden, generator=generator)
    weight = torch.randn(2 * width, hidden, generator=generator) / hidden ** 0.5
    bias = torch.randn(2 * width, generator=generator) if with_bias else None
    expected = swiglu_matmul_reference(x, weight, bias)
    assert expected.shape == (tokens, width)
    torch.testing.assert_close(triton_swiglu_matmul(x, weight, bias, tma), expected, atol=1e-5, rtol=1e-5)


def test_descriptors_need_16_byte_rows(triton_swiglu_matmul):
    x, weight = torch.randn(5, 42), torch.randn(24, 42)  # float32 rows of 42 x 4 bytes
    assert not kernels.takes_tma(x, weight, any_device=True)
    with pytest.raises(ValueError, match="multiples of 4"):
        triton_swiglu_matmul(x, weight, tma=True)
    torch.testing.assert_close(triton_swiglu_matmul(x, weight), swiglu_matmul_reference(x, weight),
                               atol=1e-5, rtol=1e-5)  # None: the pointer kernel


def test_reference_is_the_decoders_swiglu_activation():
    from rerankit.engine.models.layers import swiglu

    x, weight = torch.randn(9, 32), torch.randn(48, 32)
    identity = torch.eye(24)
    torch.testing.assert_close(F.linear(swiglu_matmul_reference(x, weight), identity),
                               swiglu(x, weight, None, identity, None))


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"weight must be \[2I, 8\]"):
        kernels.swiglu_matmul(torch.randn(3, 8), torch.randn(7, 8))
    with pytest.raises(ValueError, match=r"bias must be \[6\]"):
        kernels.swiglu_matmul(torch.randn(3, 8), torch.randn(6, 8), torch.randn(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_float32_takes_the_pointer_kernel():
    """The descriptor kernel's tiles fill shared memory at 16 bits an element: float32 goes through pointers by
    default, and asking for descriptors says why not."""
    x = torch.randn(300, 64, device="cuda")
    weight = torch.randn(96, 64, device="cuda") / 8
    assert not kernels.takes_tma(x, weight) and kernels.takes_tma(x.bfloat16(), weight.bfloat16())
    with pytest.raises(ValueError, match=r"16-bit \(or float8\) inputs"):
        kernels.swiglu_matmul(x, weight, tma=True)
    torch.testing.assert_close(kernels.swiglu_matmul(x, weight), swiglu_matmul_reference(x, weight),
                               atol=2e-2, rtol=2e-2)  # tf32 dots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_bf16_qwen3_mlp_shape_follows_the_torch_path():
    """Qwen3-0.6B's gate/up (d = 1,024, I = 3,072) over 5,000 tokens in bf16: within a bf16 rounding or two."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(5000, 1024, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(6144, 1024, device="cuda", generator=generator) / 32).bfloat16()
    expected = swiglu_matmul_reference(x, weight).float()
    got = kernels.swiglu_matmul(x, weight).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens, width, hidden", [(777, 1000, 1000), (130, 136, 72)])
def test_gpu_bf16_edges_of_the_wide_tiles(tokens, width, hidden):
    """Rows, columns and K that the 128-row, 2 x 128-column, 64-deep tiles do not divide: the copy engine's zeros
    past the edges and the clipped store keep every real element right, and the bias lands on both halves."""
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(2 * width, hidden, device="cuda", generator=generator) / hidden ** 0.5).bfloat16()
    bias = torch.randn(2 * width, device="cuda", generator=generator).bfloat16()
    assert kernels.takes_tma(x, weight)
    expected = swiglu_matmul_reference(x, weight, bias).float()
    torch.testing.assert_close(kernels.swiglu_matmul(x, weight, bias, tma=True).float(), expected,
                               atol=2e-2, rtol=2e-2)
