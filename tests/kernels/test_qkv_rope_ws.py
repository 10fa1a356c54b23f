"""The warp-specialized FP8 q/k/v kernel (Gluon): which calls it takes, and on an sm_90 GPU that its output is the
Triton kernel's bit for bit, eagerly and replayed from a CUDA graph."""

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from rerankit.kernels import qkv_rope_matmul, qkv_rope_ws  # noqa: E402
from rerankit.kernels.fp8_quant import quantize_rows_reference, rms_norm_quant  # noqa: E402
from test_qkv_rope_matmul import make_inputs  # noqa: E402

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def fp8_inputs(tokens, hidden, heads, kv_heads, norm=True, bias=False, device="cuda", seed=0):
    """make_inputs' tensors with x and the weight quantized as the FP8 decoder does (x per token, the weight per
    output channel), and the call's keyword arguments."""
    inputs, _, _ = make_inputs(tokens, hidden, heads, kv_heads, 128, norm, bias, dtype=torch.bfloat16, device=device,
                               seed=seed)
    codes, x_scale = rms_norm_quant(inputs["x"], torch.ones(hidden, dtype=torch.bfloat16, device=device), 1e-6)
    weight, w_scale = quantize_rows_reference(inputs["weight"])
    inputs = {**inputs, "x": codes, "weight": weight}
    return inputs, dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=128, x_scale=x_scale, w_scale=w_scale)


def test_takes_no_cpu_tensors():
    inputs, _ = fp8_inputs(4096, 64, 2, 2, device="cpu")
    assert not qkv_rope_ws.takes_ws(inputs["x"], inputs["weight"], 2, 2, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90 or not qkv_rope_ws.available(), reason="needs an sm_90 GPU and Gluon")
def test_gpu_takes_fp8_projections_of_even_heads_from_2048_tokens():
    inputs, _ = fp8_inputs(qkv_rope_ws.MIN_TOKENS, 256, 4, 2)
    x, weight = inputs["x"], inputs["weight"]
    assert qkv_rope_ws.takes_ws(x, weight, 4, 2, 128)
    assert not qkv_rope_ws.takes_ws(x[:-1], weight, 4, 2, 128)  # below MIN_TOKENS
    assert not qkv_rope_ws.takes_ws(x, weight[:5 * 128], 3, 1, 128)  # odd head counts: a tile would mix q and k
    assert not qkv_rope_ws.takes_ws(x.bfloat16(), weight.bfloat16(), 4, 2, 128)  # 16-bit: the Triton kernel
    assert not qkv_rope_ws.takes_ws(x[:, :240], weight, 4, 2, 128)  # rows not contiguous


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90 or not qkv_rope_ws.available(), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("tokens", [2048, 2500, 5000])
@pytest.mark.parametrize("hidden, heads, norm, bias", [(1024, 16, True, False), (2560, 32, True, False),
                                                       (512, 4, False, True)], ids=["0.6b", "4b", "bias-no-norm"])
def test_gpu_output_is_the_triton_kernels_bit_for_bit(monkeypatch, tokens, hidden, heads, norm, bias):
    """Both kernels sum the same K steps in the same order and share the epilogue's arithmetic; partial tiles at
    the end of the tokens included. Through ``qkv_rope_matmul``, which picks the Gluon kernel here unless told."""
    inputs, kwargs = fp8_inputs(tokens, hidden, heads, 8 if heads > 4 else 2, norm, bias, seed=tokens)
    calls = []
    real = qkv_rope_ws.qkv_rope_ws
    monkeypatch.setattr(qkv_rope_ws, "qkv_rope_ws", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = qkv_rope_matmul.qkv_rope_matmul(**inputs, **kwargs)
    assert calls, "the warp-specialized kernel did not run"
    monkeypatch.setenv(qkv_rope_matmul.KERNEL_ENV, "triton")
    expected = qkv_rope_matmul.qkv_rope_matmul(**inputs, **kwargs)
    assert len(calls) == 1
    assert torch.equal(got, expected)
    reference = qkv_rope_matmul.qkv_rope_matmul_reference(**inputs, **kwargs)
    torch.testing.assert_close(got.float(), reference.float(), atol=0.07, rtol=2 ** -7)  # FP8 dots: see test_fp8


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SM90 or not qkv_rope_ws.available(), reason="needs an sm_90 GPU and Gluon")
def test_gpu_replays_from_a_cuda_graph():
    inputs, kwargs = fp8_inputs(4096, 1024, 16, 8)
    eager = qkv_rope_matmul.qkv_rope_matmul(**inputs, **kwargs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qkv_rope_matmul.qkv_rope_matmul(**inputs, **kwargs)  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = qkv_rope_matmul.qkv_rope_matmul(**inputs, **kwargs)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_a_gluon_kernel_that_does_not_compile_gives_way_to_the_triton_kernel(monkeypatch, caplog):
    """On a triton whose Gluon API differs, the first call logs the failure and the caller's Triton kernel runs;
    later calls do not try the Gluon kernel again."""
    from triton.compiler.errors import CompilationError

    import rerankit.kernels as kernels

    monkeypatch.setattr(kernels, "_GLUON_BROKEN", set())
    tries = []

    def broken():
        tries.append(1)
        raise CompilationError("gl.warp_specialize(...)", None, "unexpected keyword") from TypeError("old API")

    with caplog.at_level("WARNING", logger="rerankit.engine"):
        assert kernels.run_gluon("q/k/v GEMM", broken) is None
        assert kernels.run_gluon("q/k/v GEMM", broken) is None
    assert len(tries) == 1
    assert "q/k/v GEMM kernel (Gluon) does not compile" in caplog.text and "TypeError: old API" in caplog.text
    assert kernels.run_gluon("attention", lambda: "ran") == "ran"  # one kernel's failure does not stop the others
