"""qk_norm_rope: the Triton kernel against the torch reference (the decoder's own rms_norm and apply_rotary).

Small cases run the kernel in Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1 there), compiled
where a GPU is present; the `gpu` test uses the Qwen3-0.6B head shape.
"""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

from rerankit.kernels import qk_norm_rope as kernels  # noqa: E402
from rerankit.kernels.qk_norm_rope import qk_norm_rope_reference  # noqa: E402
from triton_paths import forbid_reference  # noqa: E402

TOLERANCE = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_qk_norm_rope(monkeypatch):
    """`qk_norm_rope` on the Triton path (its torch fallback fails), with inputs and outputs on the CPU."""
    forbid_reference(monkeypatch, kernels, "qk_norm_rope_reference")

    def run(qkv, *args, **kwargs):
        moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
        q, k = kernels.qk_norm_rope(qkv.to(DEVICE), *moved, **kwargs)
        return q.cpu(), k.cpu()

    return run


def restarting_positions(tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Packed positions as MIS builds them: sequences, each a prefix then item spans restarting after it."""
    positions = []
    while len(positions) < tokens:
        prefix = int(torch.randint(0, 6, (), generator=generator))
        positions += range(prefix)
        for _ in range(int(torch.randint(1, 4, (), generator=generator))):
            positions += range(prefix, prefix + int(torch.randint(1, 9, (), generator=generator)))
    return torch.tensor(positions[:tokens])


def make_inputs(tokens, heads, kv_heads, head_dim, norm, dtype=torch.float32, seed=0, max_position=None):
    """qkv [T, (Hq + 2 Hkv) D] of random values, positions, inv_freq (theta 10^6) and optional norm weights."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    if max_position is None:
        positions = restarting_positions(tokens, gen)
    else:
        positions = torch.randint(0, max_position, (tokens,), generator=gen)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    weights = (None, None)
    if norm:
        weights = tuple((torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2))
    return qkv, positions, inv_freq, *weights


def as_float(*tensors):
    return [None if t is None else t.float() for t in tensors]


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary_only"])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 2), (8, 1)])
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_kernel_matches_reference(triton_qk_norm_rope, tokens, heads, kv_heads, head_dim, norm):
    qkv, positions, inv_freq, q_norm, k_norm = make_inputs(tokens, heads, kv_heads, head_dim, norm)
    q, k = triton_qk_norm_rope(qkv, heads, kv_heads, head_dim, positions, inv_freq, q_norm, k_norm, 1e-6)
    expected_q, expected_k = qk_norm_rope_reference(qkv, heads, kv_heads, head_dim, positions, inv_freq, q_norm,
                                                    k_norm, 1e-6)
    assert q.shape == (tokens, heads, head_dim) and k.shape == (tokens, kv_heads, head_dim)
    assert q.is_contiguous() and k.is_contiguous()
    torch.testing.assert_close(q, expected_q, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(k, expected_k, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary_only"])
def test_bfloat16_rounds_once_from_float32(triton_qk_norm_rope, norm):
    """bf16 in and out, float32 inside: within one bf16 rounding of the float32 reference on the same values.

    A GPU rounds to nearest (half an ulp, at most 2^-8 relative); Triton's interpreter truncates float32 to
    bfloat16, up to a whole ulp (2^-7).
    """
    qkv, positions, inv_freq, q_norm, k_norm = make_inputs(37, 4, 2, 64, norm, dtype=torch.bfloat16, seed=1)
    q, k = triton_qk_norm_rope(qkv, 4, 2, 64, positions, inv_freq, q_norm, k_norm, 1e-6)
    assert q.dtype == k.dtype == torch.bfloat16
    expected_q, expected_k = qk_norm_rope_reference(*as_float(qkv), 4, 2, 64, positions, inv_freq,
                                                    *as_float(q_norm, k_norm), 1e-6)
    rounding = 2**-8 if DEVICE == "cuda" else 2**-7
    torch.testing.assert_close(q.float(), expected_q, atol=1e-5, rtol=rounding)
    torch.testing.assert_close(k.float(), expected_k, atol=1e-5, rtol=rounding)


def test_large_positions_and_strided_rows(triton_qk_norm_rope):
    """Positions up to 40k (angles far past 2 pi) and qkv rows that are a slice of wider rows."""
    qkv, positions, inv_freq, q_norm, k_norm = make_inputs(50, 4, 2, 64, True, seed=2, max_position=40960)
    wide = torch.cat([qkv, torch.full((50, 5), float("nan"))], dim=1)[:, :qkv.shape[1]]
    q, k = triton_qk_norm_rope(wide, 4, 2, 64, positions, inv_freq, q_norm, k_norm, 1e-6)
    expected_q, expected_k = qk_norm_rope_reference(qkv, 4, 2, 64, positions, inv_freq, q_norm, k_norm, 1e-6)
    torch.testing.assert_close(q, expected_q, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(k, expected_k, atol=TOLERANCE, rtol=TOLERANCE)


def test_no_tokens(triton_qk_norm_rope):
    qkv, positions, inv_freq, _, _ = make_inputs(0, 4, 2, 16, False)
    q, k = triton_qk_norm_rope(qkv, 4, 2, 16, positions, inv_freq)
    assert q.shape == (0, 4, 16) and k.shape == (0, 2, 16)


@pytest.mark.parametrize("head_dim", [8, 24, 48])
def test_head_dim_must_be_a_power_of_two_of_at_least_16(head_dim):
    qkv, positions, inv_freq, _, _ = make_inputs(3, 2, 1, head_dim, False)
    with pytest.raises(ValueError, match="power of two"):
        kernels.qk_norm_rope(qkv, 2, 1, head_dim, positions, inv_freq)


def test_bad_shapes_are_refused():
    qkv, positions, inv_freq, q_norm, k_norm = make_inputs(3, 2, 1, 16, True)
    with pytest.raises(ValueError, match="qkv must be"):
        kernels.qk_norm_rope(qkv, 2, 2, 16, positions, inv_freq)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        kernels.qk_norm_rope(qkv, 2, 1, 16, positions, inv_freq, q_norm, None)
    with pytest.raises(ValueError, match="inv_freq"):
        kernels.qk_norm_rope(qkv, 2, 1, 16, positions, inv_freq[:4])
    with pytest.raises(ValueError, match="position_ids"):
        kernels.qk_norm_rope(qkv, 2, 1, 16, positions[:2], inv_freq)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "rotary_only"])
def test_bf16_gpu_at_qwen3_head_shape(norm):
    qkv, positions, inv_freq, q_norm, k_norm = make_inputs(3001, 16, 8, 128, norm, dtype=torch.bfloat16,
                                                           max_position=40960)
    args = [None if t is None else t.cuda() for t in (qkv, positions, inv_freq, q_norm, k_norm)]
    q, k = kernels.qk_norm_rope(args[0], 16, 8, 128, *args[1:], eps=1e-6)
    float_args = [None if t is None else t.float() for t in args]
    expected_q, expected_k = qk_norm_rope_reference(float_args[0], 16, 8, 128, args[1], args[2], *float_args[3:],
                                                    eps=1e-6)
    torch.testing.assert_close(q.float(), expected_q, atol=1e-3, rtol=2**-8)
    torch.testing.assert_close(k.float(), expected_k, atol=1e-3, rtol=2**-8)
