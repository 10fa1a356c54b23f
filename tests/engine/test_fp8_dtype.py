"""dtype="fp8": a clear error where there are no FP8 tensor cores, FP8's numerics in reference mode on the CPU
(against float32), checkpoints stored in FP8 (quant_method "fp8" with block scales, compressed-tensors per channel),
and on a GPU with FP8 tensor cores the kernels against the references."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rerankit.engine import EmbeddedBackend
from rerankit.engine.fp8 import PROJECTIONS_ENV, REFERENCE_ENV, per_channel
from rerankit.engine.load import load_model
from rerankit.errors import ModelLoadError
from rerankit.kernels.fp8_quant import FP8_DTYPE, dequantize_rows, quantize_rows_reference
from rerankit.schema import ScoreRequest

HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DOCS = ["Paris is the capital and most populous city of France.", "Gravity attracts two bodies.",
        "the quick brown fox jumps over the lazy dog", "The capital of China is Beijing.", "yes no Yes No"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def request(multi_item=True):
    return ScoreRequest(query="What is the capital of France?", items=DOCS, template="qwen3-reranker",
                        multi_item=multi_item)


@pytest.fixture
def reference_mode(monkeypatch):
    monkeypatch.setenv(REFERENCE_ENV, "1")


def test_fp8_without_fp8_tensor_cores_is_a_clear_error(tiny_qwen3_lm, monkeypatch):
    monkeypatch.delenv(REFERENCE_ENV, raising=False)
    with pytest.raises(ModelLoadError, match=r"dtype 'fp8' needs a CUDA GPU with FP8 tensor cores \(compute "
                                             r"capability 8.9.*cpu is not a CUDA GPU.*bfloat16"):
        EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="fp8")


def test_fp8_runs_on_the_packed_runner_only(tiny_qwen3_lm, tiny_bert_cross_encoder, reference_mode):
    for model in (tiny_qwen3_lm, tiny_bert_cross_encoder):  # encoders: test_fp8_encoder.py
        with pytest.raises(ModelLoadError, match="packed runner"):
            EmbeddedBackend(str(model), device="cpu", dtype="fp8", runner="reference")


def test_fp8_reference_follows_float32(tiny_qwen3_lm, reference_mode, monkeypatch):
    """FP8 projections, the rest in bf16: the four projections' weights are float8 codes with per-channel scales,
    and the scores stay within 0.01 of float32's (bf16's own deviation on this model is ~0.001); scoring with a
    shared prefix (MIS) gives the pair-by-pair scores."""
    monkeypatch.setenv(PROJECTIONS_ENV, "qkv,o,gate_up,down")  # the tiny model's default leaves o and down bf16
    fp8 = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="fp8")
    model = fp8._runner.model
    layer = model.layers[0]
    assert all(getattr(layer, f"{name}_weight").dtype == FP8_DTYPE for name in ("qkv", "o", "gate_up", "down"))
    assert layer.gate_up_scale.shape == (layer.gate_up_weight.shape[0],)
    # quantized without autograd: a scale with a graph kept float32 copies of its weight alive (8 bytes a weight)
    assert all(buffer.grad_fn is None for buffer in model.buffers())
    assert all(parameter.grad_fn is None for parameter in model.parameters())
    scores = torch.tensor(fp8.score(request()).scores)
    fp32 = torch.tensor(EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="float32").score(request()).scores)
    assert (scores - fp32).abs().max() < 1e-2
    assert (scores - fp32).abs().max() > 0  # FP8 rounding did happen
    torch.testing.assert_close(torch.tensor(fp8.score(request(multi_item=False)).scores), scores,
                               atol=2e-3, rtol=0)


def test_fp8_kernels_in_the_interpreter_follow_the_reference_steps(tiny_qwen3_lm, reference_mode, monkeypatch):
    """The kernels' steps (Triton's interpreter on the CPU; cuBLAS's GEMM is the reference there) with all four
    projections in FP8: the SwiGLU GEMM writes the down projection's float8 input itself (no quantization pass),
    and the scores are the reference steps' within FP8's rounding."""
    from rerankit.engine.models import fp8 as fp8_layers
    from rerankit.kernels import swiglu_matmul

    if torch.cuda.is_available() or not swiglu_matmul._INTERPRET:
        pytest.skip("the interpreter's run of the kernels (a GPU runs them in test_gpu_fp8_kernels_follow_...)")
    monkeypatch.setenv(PROJECTIONS_ENV, "qkv,o,gate_up,down")
    backend = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="fp8")
    model = backend._runner.model
    reference = torch.tensor(backend.score(request()).scores)
    passes = []
    model.fp8 = dataclasses.replace(
        fp8_layers.KERNELS, quant=lambda *a: passes.append("rows") or fp8_layers.quantize_rows(*a),
        quant_bounded=lambda *a: passes.append("bounded") or fp8_layers.quantize_bounded(*a))
    kernels = torch.tensor(backend.score(request()).scores)
    assert passes == []  # neither down's nor o's input took a quantization pass
    torch.testing.assert_close(kernels, reference, atol=5e-3, rtol=0)
    # without the copy engine (Ada) gate/up goes through cuBLAS and down's input through a pass, one a layer
    monkeypatch.setattr(fp8_layers, "swiglu_takes_tma", lambda *args: False)
    fallback = torch.tensor(backend.score(request()).scores)
    assert passes == ["rows"] * len(model.layers)  # one micro-batch on the CPU
    torch.testing.assert_close(fallback, reference, atol=5e-3, rtol=0)


def test_fp8_projections_can_be_chosen(tiny_qwen3_lm, reference_mode, monkeypatch):
    """$RERANKIT_FP8_PROJECTIONS: the named projections become float8, the others keep their bf16 weights and run
    as the bf16 engine runs them; the scores stay near float32's. An unknown name is a clear error."""
    fp32 = torch.tensor(EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="float32").score(request()).scores)
    monkeypatch.setenv(PROJECTIONS_ENV, "gate_up, qkv")
    fp8 = EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="fp8")
    layer = fp8._runner.model.layers[0]
    assert [getattr(layer, f"{name}_weight").dtype for name in ("qkv", "o", "gate_up", "down")] == \
        [FP8_DTYPE, torch.bfloat16, FP8_DTYPE, torch.bfloat16]
    assert not hasattr(layer, "o_scale")
    scores = torch.tensor(fp8.score(request()).scores)
    assert 0 < (scores - fp32).abs().max() < 1e-2
    monkeypatch.setenv(PROJECTIONS_ENV, "down")  # the other way round: bf16 q/k/v and gate/up, FP8 down
    scores = torch.tensor(EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="fp8").score(request()).scores)
    assert 0 < (scores - fp32).abs().max() < 1e-2
    monkeypatch.setenv(PROJECTIONS_ENV, "qkv,mlp")
    with pytest.raises(ModelLoadError, match=r"RERANKIT_FP8_PROJECTIONS names \['mlp'\].*qkv, o, gate_up, down"):
        EmbeddedBackend(str(tiny_qwen3_lm), device="cpu", dtype="fp8")


def test_o_and_down_stay_bf16_below_the_hidden_size_where_fp8_pays(monkeypatch):
    from rerankit.engine.fp8 import ALL_PROJECTIONS, RESIDUAL_FP8_MIN_HIDDEN, projections

    monkeypatch.delenv(PROJECTIONS_ENV, raising=False)
    assert projections(1024) == ("qkv", "gate_up")
    assert projections(RESIDUAL_FP8_MIN_HIDDEN) == projections(4096) == ALL_PROJECTIONS
    monkeypatch.setenv(PROJECTIONS_ENV, "down,qkv")
    assert projections(1024) == projections(4096) == ("qkv", "down")


def fp8_checkpoint(source, target, quant_method, projections=PROJECTIONS):
    """``source`` with its ``projections`` (the decoder's by default) stored as float8 codes: quant_method "fp8" with
    32 x 32 block scales (``weight_scale_inv``), or compressed-tensors with per-channel scales (``weight_scale``
    [N, 1])."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    for name in [name for name in tensors if name.endswith(tuple(f"{p}.weight" for p in projections))]:
        weight = tensors[name].float()
        if quant_method == "fp8":
            blocks = weight.unflatten(0, (-1, 32)).unflatten(2, (-1, 32))  # [N/32, 32, K/32, 32]
            scale = blocks.abs().amax(dim=(1, 3)) / 448
            expanded = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
            tensors[name] = (weight / expanded).to(FP8_DTYPE)
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
        else:
            codes, scale = quantize_rows_reference(weight)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = codes, scale[:, None]
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
        if quant_method == "fp8" else
        {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
                                                                          "strategy": "channel"}}}})
    (target / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("quant_method", ["fp8", "compressed-tensors"])
def test_fp8_checkpoints_load_directly(tiny_qwen3_lm, tmp_path, quant_method, monkeypatch):
    """Without FP8 tensor cores the checkpoint runs dequantized (float32 on the CPU), its weights codes x scales; in
    FP8 (reference mode: dtype None takes the stored FP8) the packed decoder keeps the stored codes (per channel) or
    requantizes the block-scaled weight per channel, and scores follow the dequantized float32 model."""
    folder = tmp_path / quant_method
    tensors = fp8_checkpoint(tiny_qwen3_lm, folder, quant_method)
    monkeypatch.delenv(REFERENCE_ENV, raising=False)
    dequantized = load_model(str(folder), device="cpu")
    assert not dequantized.fp8 and dequantized.dtype == torch.float32
    q_proj = dequantized.model.model.layers[0].self_attn.q_proj.weight
    name = "model.layers.0.self_attn.q_proj.weight"
    scale = tensors[name.removesuffix("weight") + ("weight_scale_inv" if quant_method == "fp8" else "weight_scale")]
    expected = dequantize_rows(*per_channel(tensors[name], scale)) if quant_method != "fp8" else \
        tensors[name].float() * scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
    torch.testing.assert_close(q_proj, expected, atol=0, rtol=0)
    fp32 = torch.tensor(EmbeddedBackend(str(folder), device="cpu").score(request()).scores)
    monkeypatch.setenv(REFERENCE_ENV, "1")
    backend = EmbeddedBackend(str(folder), device="cpu")
    assert backend._model().fp8 and backend._model().fp8_weights is None  # handed to the packed decoder
    qkv = backend._runner.model.layers[0].qkv_weight
    if quant_method != "fp8":
        stored = [tensors[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(qkv.float(), torch.cat(stored).float())
    assert (torch.tensor(backend.score(request()).scores) - fp32).abs().max() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("projections", ["", "qkv,o,gate_up,down"], ids=["default", "all"])
def test_gpu_fp8_kernels_follow_the_references(tiny_qwen3_lm, cuda_graphs, projections, monkeypatch):
    """On the GPU the Triton and cuBLAS FP8 steps (with and without CUDA graphs; o and down in bf16 as the tiny
    model's default, and in FP8 with their outputs added by the next norm's kernel) give the reference steps'
    scores, and both stay near float32's."""
    from rerankit.engine.models import fp8 as fp8_layers

    monkeypatch.setenv(PROJECTIONS_ENV, projections)

    backend = EmbeddedBackend(str(tiny_qwen3_lm), device="cuda", dtype="fp8", cuda_graphs=cuda_graphs)
    model = backend._runner.model
    assert model.fp8 is fp8_layers.KERNELS
    kernels = torch.tensor(backend.score(request()).scores)
    model.fp8 = fp8_layers.REFERENCE
    backend._runner.graphs = None
    reference = torch.tensor(backend.score(request()).scores)
    fp32 = torch.tensor(EmbeddedBackend(str(tiny_qwen3_lm), device="cuda", dtype="float32").score(request()).scores)
    torch.testing.assert_close(kernels, reference, atol=5e-3, rtol=0)
    assert (kernels - fp32).abs().max() < 2e-2
