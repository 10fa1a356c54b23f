"""dtype="fp8" on encoders (BERT, RoBERTa, XLM-R): the four projections' weights as float8 codes with per-channel
scales, the packaged MiniLM's real weights scored near float32 in reference mode on the CPU, FP8 checkpoints' codes
kept as stored, a clear error for what the packed encoder cannot run, and on a GPU cuBLAS's steps against the
reference's."""

import json

import pytest
import torch

from rerankit.engine import EmbeddedBackend
from rerankit.engine.fp8 import REFERENCE_ENV
from rerankit.engine.models.encoder_fp8 import GPU_STEPS, PROJECTIONS, REFERENCE_STEPS
from rerankit.errors import ModelLoadError
from rerankit.kernels.fp8_quant import FP8_DTYPE
from rerankit.schema import ScoreRequest
from test_fp8_dtype import HAS_FP8_GPU, fp8_checkpoint
from tiny_models import _minilm_folder, make_bert_cross_encoder

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and most populous city of France.", "Gravity attracts two bodies.",
        "the quick brown fox jumps over the lazy dog", "The capital of China is Beijing.",
        "France's capital city, Paris, lies on the Seine.", "yes no Yes No", "Berlin is in Germany.",
        "The Eiffel Tower stands in Paris."]
BERT_PROJECTIONS = ("query", "key", "value", "output.dense", "intermediate.dense")  # output.dense: o and down


@pytest.fixture
def reference_mode(monkeypatch):
    monkeypatch.setenv(REFERENCE_ENV, "1")


def scores(backend: EmbeddedBackend) -> torch.Tensor:
    return torch.tensor(backend.score(ScoreRequest(query=QUERY, items=DOCS)).scores)


def test_fp8_encoder_layers_hold_float8_codes_and_release_the_16_bit_weights(tiny_bert_cross_encoder,
                                                                            reference_mode):
    backend = EmbeddedBackend(str(tiny_bert_cross_encoder), device="cpu", dtype="fp8")
    model = backend._runner.model
    assert model.fp8_steps is REFERENCE_STEPS
    for layer in model.layers:
        for name in PROJECTIONS:
            weight, scale = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_scale")
            assert weight.dtype == FP8_DTYPE and scale.shape == (weight.shape[0],) and scale.dtype == torch.float32
        assert layer.qkv_bias.dtype == layer.attention_norm_weight.dtype == torch.bfloat16
    assert all(tensor.grad_fn is None for tensor in [*model.parameters(), *model.buffers()])
    hf_layer = backend._model().model.base_model.encoder.layer[0]
    assert hf_layer.attention.self.query.weight.numel() == 0 and hf_layer.output.dense.weight.numel() == 0
    assert len(scores(backend)) == len(DOCS)


def test_fp8_minilm_real_weights_score_near_float32(reference_mode):
    """The packaged MiniLM (a bi-encoder, real weights): FP8 scores within 0.03 of float32's and ranked alike where
    float32 sets them apart; bf16's own deviation is ~0.002 (FP8's 3-bit mantissa against bf16's 8)."""
    fp8 = scores(EmbeddedBackend(str(_minilm_folder()), device="cpu", dtype="fp8"))
    fp32 = scores(EmbeddedBackend(str(_minilm_folder()), device="cpu", dtype="float32"))
    deviation = (fp8 - fp32).abs().max()
    assert 0 < deviation < 0.03
    apart = (fp32[:, None] - fp32[None, :]).abs() > 0.05
    assert torch.equal((fp8[:, None] > fp8[None, :])[apart], (fp32[:, None] > fp32[None, :])[apart])


def test_fp8_encoder_checkpoint_codes_run_as_stored(tiny_bert_cross_encoder, tmp_path, reference_mode):
    """A compressed-tensors BERT (per-channel float8 weights) runs in FP8 on the stored codes."""
    folder = tmp_path / "bert-fp8"
    tensors = fp8_checkpoint(tiny_bert_cross_encoder, folder, "compressed-tensors", BERT_PROJECTIONS)
    backend = EmbeddedBackend(str(folder), device="cpu")
    assert backend._model().fp8
    layer = backend._runner.model.layers[1]
    stored = [tensors[f"bert.encoder.layer.1.attention.self.{p}.weight"] for p in ("query", "key", "value")]
    assert torch.equal(layer.qkv_weight.float(), torch.cat(stored).float())
    assert torch.equal(layer.down_weight.float(), tensors["bert.encoder.layer.1.output.dense.weight"].float())
    fp32 = EmbeddedBackend(str(folder), device="cpu", dtype="float32")
    assert (scores(backend) - scores(fp32)).abs().max() < 1e-2


def test_fp8_on_an_encoder_the_packed_runner_cannot_run_is_a_clear_error(tmp_path, reference_mode):
    folder = make_bert_cross_encoder(tmp_path, name="bert-relative")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ModelLoadError, match=r"packed decoders .* and encoders \(bert, roberta, xlm-roberta\) only"
                                             r".*position_embedding_type 'relative_key'.*bfloat16"):
        EmbeddedBackend(str(folder), device="cpu", dtype="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gpu_fp8_encoder_follows_the_reference_steps(cuda_graphs):
    """On the GPU, cuBLAS's FP8 GEMMs and the Triton activation inside the compiled steps (replayed from CUDA graphs
    or not) score as the references do, within FP8's rounding (an accumulation order that moves one product across a rounding
    boundary changes the next layer's codes), and both stay near float32's."""
    backend = EmbeddedBackend(str(_minilm_folder()), device="cuda", dtype="fp8", cuda_graphs=cuda_graphs)
    model = backend._runner.model
    assert model.fp8_steps is GPU_STEPS
    kernels = scores(backend)
    reference = EmbeddedBackend(str(_minilm_folder()), device="cuda", dtype="fp8", cuda_graphs=False)
    reference._runner.model.fp8_steps = REFERENCE_STEPS
    fp32 = scores(EmbeddedBackend(str(_minilm_folder()), device="cuda", dtype="float32"))
    referenced = scores(reference)
    torch.testing.assert_close(kernels, referenced, atol=0.02, rtol=0)
    assert (kernels - fp32).abs().max() < 0.03 and (referenced - fp32).abs().max() < 0.03


@pytest.mark.parametrize("name", ["bert", "bert-seq-cls", "xlm-roberta-seq-cls"])
def test_fp8_packed_encoder_follows_transformers_on_each_architecture(tmp_path, name, reference_mode):
    """BERT (base model and classifier) and XLM-R (position offset, one segment): the FP8 block's hidden states stay
    within 1% of transformers' float32 ones, and differ from them (the projections were quantized)."""
    from rerankit.engine.models import build_packed_model
    from test_models import ENCODERS, load_tiny, pack, per_sequence_hidden, random_sequences

    model_class, make_config = ENCODERS[name]
    hf = load_tiny(tmp_path, model_class, make_config())
    sequences = random_sequences([8, 3, 13], seed=4)
    types = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) if hf.config.type_vocab_size > 1 else [0] * len(s)
             for s in sequences]
    expected = torch.cat(per_sequence_hidden(hf, sequences, token_type_ids=types))  # before the weights are let go
    packed = build_packed_model(hf, fp8=True)
    assert packed.fp8_steps is REFERENCE_STEPS
    hidden = packed(pack(sequences, causal=False, token_types=types)).float()
    error = (hidden - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert 0 < error.max() < 0.01  # 0.002 on these shapes
