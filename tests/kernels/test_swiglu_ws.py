"""The warp-specialized (ping-pong) FP8 SwiGLU GEMM (Gluon): which calls it takes, and on an sm_90 GPU that its
output (bf16, or float8 codes and row scales) is the Triton kernel's bit for bit, eagerly and replayed from a CUDA
graph."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from rerankit.kernels import swiglu_matmul, swiglu_ws  # noqa: E402
from test_fp8_kernels import swiglu_fp8_inputs  # noqa: E402

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_sm90 = pytest.mark.skipif(not HAS_SM90 or not swiglu_ws.available(), reason="needs an sm_90 GPU and Gluon")


def test_takes_no_cpu_tensors():
    codes, _, _, weight, _ = swiglu_fp8_inputs(swiglu_ws.MIN_TOKENS, 64, 64, 0, device="cpu")
    assert not swiglu_ws.takes_ws(codes, weight)


@pytest.mark.gpu
@needs_sm90
def test_gpu_takes_bias_free_fp8_projections_from_2048_tokens():
    codes, _, _, weight, _ = swiglu_fp8_inputs(swiglu_ws.MIN_TOKENS, 256, 128, 0, device="cuda")
    assert swiglu_ws.takes_ws(codes, weight)
    assert not swiglu_ws.takes_ws(codes[:-1], weight)  # below MIN_TOKENS
    assert not swiglu_ws.takes_ws(codes, weight, torch.zeros(256, device="cuda"))  # a bias: the Triton kernel
    assert not swiglu_ws.takes_ws(codes.bfloat16(), weight.bfloat16())  # 16-bit: the Triton kernel
    assert not swiglu_ws.takes_ws(codes[:, :240], weight[:, :240])  # rows not contiguous


def _both(monkeypatch, run):
    """``run()`` through the Gluon kernel (checked to have run), then through the Triton kernel."""
    calls = []
    real = swiglu_ws.swiglu_ws
    monkeypatch.setattr(swiglu_ws, "swiglu_ws", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = run()
    assert calls, "the warp-specialized kernel did not run"
    monkeypatch.setenv(swiglu_matmul.KERNEL_ENV, "triton")
    expected = run()
    assert len(calls) == 1
    return got, expected


SHAPES = [(1024, 3072), (2560, 9728), (4096, 12288), (512, 208)]  # 0.6B, 4B, 8B, I not a multiple of the tile


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tokens", [2048, 2500, 5000])
@pytest.mark.parametrize("hidden, width", SHAPES, ids=["0.6b", "4b", "8b", "ragged"])
def test_gpu_bf16_output_is_the_triton_kernels_bit_for_bit(monkeypatch, tokens, hidden, width):
    """Both kernels sum the same K steps in the same order and share the epilogue's arithmetic; partial tiles at
    the end of the tokens and columns included. Through ``swiglu_matmul``, which picks the Gluon kernel here."""
    codes, scale, _, weight, w_scale = swiglu_fp8_inputs(tokens, hidden, width, tokens + hidden, device="cuda")
    got, expected = _both(monkeypatch, lambda: swiglu_matmul.swiglu_matmul(codes, weight, x_scale=scale,
                                                                           w_scale=w_scale))
    assert got.shape == (tokens, width) and got.dtype == torch.bfloat16
    assert torch.equal(got, expected)
    reference = swiglu_matmul.swiglu_matmul_reference(codes, weight, x_scale=scale, w_scale=w_scale)
    # float32 sums in another order: a gate or up projection one bf16 step apart where silu is steep moves the
    # product by up to ~2^-6 of it (one element of 19.9M at 4B and 2,048 tokens: 0.156 at ~8)
    torch.testing.assert_close(got.float(), reference.float(), atol=0.07, rtol=2 ** -5)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("tokens", [2048, 5000])
@pytest.mark.parametrize("hidden, width", SHAPES, ids=["0.6b", "4b", "8b", "ragged"])
def test_gpu_fp8_output_is_the_triton_kernels_bit_for_bit(monkeypatch, tokens, hidden, width):
    codes, scale, lengths, weight, w_scale = swiglu_fp8_inputs(tokens, hidden, width, tokens, device="cuda")
    bound = swiglu_matmul.swiglu_bound(weight, w_scale)
    (got_codes, got_scale), (codes_t, scale_t) = _both(monkeypatch, lambda: swiglu_matmul.swiglu_matmul_fp8_out(
        codes, weight, scale, w_scale, lengths, bound))
    assert got_codes.dtype == codes_t.dtype and got_codes.shape == (tokens, width)
    assert torch.equal(got_codes.view(torch.uint8), codes_t.view(torch.uint8))
    assert torch.equal(got_scale, scale_t)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "fp8"])
def test_gpu_replays_from_a_cuda_graph(quant):
    codes, scale, lengths, weight, w_scale = swiglu_fp8_inputs(4096, 1024, 3072, 1, device="cuda")
    bound = swiglu_matmul.swiglu_bound(weight, w_scale)

    def run():
        if quant:
            return swiglu_matmul.swiglu_matmul_fp8_out(codes, weight, scale, w_scale, lengths, bound)[0]
        return swiglu_matmul.swiglu_matmul(codes, weight, x_scale=scale, w_scale=w_scale)

    eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    captured.view(torch.uint8).zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.uint8), eager.view(torch.uint8))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("stages", [4, 6])
def test_gpu_stage_counts_agree(stages):
    """The benchmark's other stage count (the default's alternative) gives the same output."""
    codes, scale, _, weight, w_scale = swiglu_fp8_inputs(3000, 2560, 9728, 7, device="cuda")
    default = swiglu_ws.swiglu_ws(codes, weight, scale, w_scale)
    assert torch.equal(swiglu_ws.swiglu_ws(codes, weight, scale, w_scale, stages=stages), default)
