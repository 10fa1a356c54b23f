import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's import

from rerankit.engine.models.layers import rms_norm as decoder_rms_norm  # noqa: E402
from rerankit.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402


@pytest.mark.parametrize("rows, width", [(1, 64), (7, 96), (33, 128), (5, 1000), (0, 64)])
def test_kernel_matches_the_decoders_norm(rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen) * 3
    weight = torch.rand(width, generator=gen) + 0.5
    expected = decoder_rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(rms_norm_reference(x, weight, 1e-6), expected, atol=0, rtol=0)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), expected, atol=1e-5, rtol=1e-5)


def test_strided_rows_and_bad_shapes():
    x = torch.randn(6, 200)[:, :64]  # rows 200 apart
    weight = torch.rand(64) + 0.5
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(63), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width", [1024, 2560, 4096])
def test_kernel_rounds_as_the_reference_on_gpu_bf16(width):
    x = torch.randn(3000, width, device="cuda", dtype=torch.bfloat16) * 4
    weight = (torch.rand(width, device="cuda") + 0.5).to(torch.bfloat16)
    got, expected = rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
    # Same float32 statistics and the same two roundings; the sum's order may move a value by one bf16 step.
    assert (got.float() - expected.float()).abs().max().item() <= 2 ** -7 * expected.float().abs().max().item()
    assert (got == expected).float().mean().item() > 0.99
