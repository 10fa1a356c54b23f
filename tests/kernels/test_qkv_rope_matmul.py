"""qkv_rope_matmul: the q/k/v GEMM with q/k norm and rotary in its epilogue, against its torch reference and
against the decoder's unfused steps (``F.linear``, then ``qk_norm_rope``).

Small cases run the kernel in Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1 there); the `gpu`
tests use the Qwen3-0.6B shape in bf16.
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from rerankit.kernels import qkv_rope_matmul as kernels  # noqa: E402
from rerankit.kernels.qk_norm_rope import qk_norm_rope_reference  # noqa: E402
from rerankit.kernels.qkv_rope_matmul import qkv_rope_matmul_reference, rope_table  # noqa: E402
from test_qk_norm_rope import restarting_positions  # noqa: E402
from triton_paths import forbid_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_qkv_rope(monkeypatch):
    """`qkv_rope_matmul` on the Triton path (its torch fallback fails), inputs and outputs on the CPU."""
    if DEVICE == "cuda":
        pytest.skip("on a GPU the kernel takes 16-bit inputs (the gpu tests run it)")
    forbid_reference(monkeypatch, kernels, "qkv_rope_matmul_reference")

    def run(*args, **kwargs):
        return kernels.qkv_rope_matmul(*args, **kwargs).cpu()

    return run


def make_inputs(tokens, hidden, heads, kv_heads, head_dim, norm, bias, dtype=torch.float32, seed=0,
                device="cpu"):
    """x, the fused weight and bias, cos/sin of packed MIS positions (theta 10^6), norm weights."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(tokens, hidden, generator=gen)
    weight = torch.randn(width, hidden, generator=gen) / hidden ** 0.5
    bias_values = torch.randn(width, generator=gen) if bias else None
    positions = restarting_positions(tokens, gen)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    norms = (None, None)
    if norm:
        norms = tuple(torch.rand(head_dim, generator=gen) + 0.5 for _ in range(2))
    cos, sin = rope_table(positions.to(device), inv_freq.to(device))
    tensors = [t if t is None else t.to(device=device, dtype=dtype) for t in (x, weight, bias_values, *norms)]
    x, weight, bias_values, q_norm, k_norm = tensors
    return dict(x=x, weight=weight, bias=bias_values, cos=cos, sin=sin, q_norm=q_norm, k_norm=k_norm), positions, \
        inv_freq


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (3, 1, 16), (2, 1, 32), (1, 1, 16)])
@pytest.mark.parametrize("tokens, hidden", [(37, 40), (1, 16), (50, 24)])
@pytest.mark.parametrize("norm, bias", [(True, False), (False, True)], ids=["qk_norm", "bias_rotary_only"])
def test_kernel_equals_the_reference(triton_qkv_rope, tokens, hidden, heads, kv_heads, head_dim, norm, bias):
    """Row and K tails, tiles of two heads that hold q and k or k and v heads (3 + 1 + 1 heads of 16), one head a
    tile (D = 32), one row."""
    inputs, _, _ = make_inputs(tokens, hidden, heads, kv_heads, head_dim, norm, bias)
    out = triton_qkv_rope(**inputs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    expected = qkv_rope_matmul_reference(**inputs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    assert out.shape == (tokens, (heads + 2 * kv_heads) * head_dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_no_tokens(triton_qkv_rope):
    inputs, _, _ = make_inputs(0, 16, 2, 1, 16, True, False)
    assert triton_qkv_rope(**inputs, num_heads=2, num_kv_heads=1, head_dim=16).shape == (0, 64)


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary_only"])
def test_reference_is_the_decoders_unfused_steps(norm):
    """The reference equals F.linear then the decoder's q/k norm and rotary (``qk_norm_rope_reference``, the
    decoder's own rms_norm and apply_rotary), v left as projected: float32, within 1e-5."""
    heads, kv_heads, head_dim = 4, 2, 32
    inputs, positions, inv_freq = make_inputs(45, 48, heads, kv_heads, head_dim, norm, True)
    out = qkv_rope_matmul_reference(**inputs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    qkv = F.linear(inputs["x"], inputs["weight"], inputs["bias"])
    q, k = qk_norm_rope_reference(qkv, heads, kv_heads, head_dim, positions, inv_freq, inputs["q_norm"],
                                  inputs["k_norm"])
    torch.testing.assert_close(out, torch.cat([q.flatten(1), k.flatten(1), qkv[:, -kv_heads * head_dim:]], 1),
                               atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused():
    inputs, _, _ = make_inputs(3, 16, 2, 1, 16, True, True)
    with pytest.raises(ValueError, match=r"weight \[96, d\]"):
        kernels.qkv_rope_matmul(**inputs, num_heads=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="power of two"):
        kernels.qkv_rope_matmul(**inputs, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="cos must be float32"):
        kernels.qkv_rope_matmul(**{**inputs, "cos": inputs["cos"][:2]}, num_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        kernels.qkv_rope_matmul(**{**inputs, "k_norm": None}, num_heads=2, num_kv_heads=1, head_dim=16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 777, 5000])
@pytest.mark.parametrize("norm, bias", [(True, False), (False, True)], ids=["qwen3", "qwen2_bias"])
def test_bf16_gpu_equals_linear_then_qk_norm_rope(tokens, norm, bias):
    """Qwen3-0.6B's shape (d 1,024, 16 + 8 heads of 128), bf16: against cuBLAS's projection then the q/k kernel,
    within two bf16 roundings (the two GEMMs sum in different orders before the projection is rounded)."""
    from rerankit.kernels.qk_norm_rope import qk_norm_rope

    inputs, positions, inv_freq = make_inputs(tokens, 1024, 16, 8, 128, norm, bias, dtype=torch.bfloat16,
                                              device="cuda")
    out = kernels.qkv_rope_matmul(**inputs, num_heads=16, num_kv_heads=8, head_dim=128)
    qkv = F.linear(inputs["x"], inputs["weight"], inputs["bias"])
    q, k = qk_norm_rope(qkv, 16, 8, 128, positions.cuda(), inv_freq.cuda(), inputs["q_norm"], inputs["k_norm"])
    expected = torch.cat([q.flatten(1), k.flatten(1), qkv[:, 24 * 128:]], 1)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2**-7)
