"""The packed models against transformers, per sequence, on tiny random models (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
import transformers
import triton

from rerankit.engine import attention as attention_module
from rerankit.engine.attention import packed_attention
from rerankit.engine.batch import PackedBatch, attention_allowed
from rerankit.engine.models import PackedDecoder, PackedEncoder, build_packed_model, supports
from triton_paths import forbid_reference

TOLERANCE = 1e-4
DECODER_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
ENCODER_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=512)


def dense_attention(q, k, v, batch, scale=None):
    """Reference packed attention: full [T, T] scores under ``attention_allowed``, GQA by repeating kv heads."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~attention_allowed(batch), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


ATTENTIONS = {"dense-reference": dense_attention, "packed": packed_attention}


def pack(sequences, causal=True, token_types=None, read_positions=None):
    """A PackedBatch of plain sequences (no shared prefix); reads each sequence's last token by default."""
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return _batch(torch.tensor([t for s in sequences for t in s]),
                  torch.cat([torch.arange(n) for n in lengths.tolist()]), cu, torch.zeros(len(sequences)),
                  starts, cu[1:].long() - 1 if read_positions is None else read_positions, causal,
                  None if token_types is None else torch.tensor([t for s in token_types for t in s]))


def pack_multi_item(prefix, items):
    """One MIS sequence: the prefix once, then each item span with positions restarting at the prefix length."""
    ids = list(prefix) + [t for item in items for t in item]
    positions = list(range(len(prefix))) + [len(prefix) + i for item in items for i in range(len(item))]
    span_starts, ends, start = [0] * len(prefix), [], len(prefix)
    for item in items:
        span_starts += [start] * len(item)
        start += len(item)
        ends.append(start - 1)
    return _batch(torch.tensor(ids), torch.tensor(positions), torch.tensor([0, len(ids)], dtype=torch.int32),
                  torch.tensor([len(prefix)]), torch.tensor(span_starts), torch.tensor(ends), True, None)


def _batch(ids, positions, cu, prefix_lens, span_starts, read_positions, causal, token_types):
    return PackedBatch(input_ids=ids.long(), position_ids=positions.long(), cu_seqlens=cu.to(torch.int32),
                       max_seqlen=int((cu[1:] - cu[:-1]).max()), prefix_lens=prefix_lens.to(torch.int32),
                       span_starts=span_starts.to(torch.int32), read_positions=read_positions.long(),
                       causal=causal,
                       token_type_ids=token_types)


def load_tiny(tmp_path, model_class, config):
    """A random tiny model saved with save_pretrained and loaded back, float32, eager attention."""
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # norms start at one; randomise them so a skipped or misplaced norm shows
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    return model_class.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()


def random_sequences(lengths, seed=1, low=3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, 256, (n,), generator=generator).tolist() for n in lengths]


DECODERS = {
    "qwen3": (transformers.Qwen3ForCausalLM,
              lambda: transformers.Qwen3Config(**DECODER_SIZES, head_dim=32, tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2ForCausalLM, lambda: transformers.Qwen2Config(**DECODER_SIZES)),
    "llama3": (transformers.LlamaForCausalLM, lambda: transformers.LlamaConfig(
        **DECODER_SIZES, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=64))),
    "qwen3-seq-cls": (transformers.Qwen3ForSequenceClassification,
                      lambda: transformers.Qwen3Config(**DECODER_SIZES, num_labels=1, pad_token_id=0)),
}


@pytest.fixture(params=sorted(DECODERS))
def decoder_pair(request, tmp_path):
    model_class, make_config = DECODERS[request.param]
    hf = load_tiny(tmp_path, model_class, make_config())
    return hf, build_packed_model(hf, attention_fn=dense_attention)


def per_sequence_hidden(hf, sequences, **inputs):
    with torch.no_grad():
        return [hf.base_model(input_ids=torch.tensor([s]), **{k: torch.tensor([v[i]]) for k, v in inputs.items()})
                .last_hidden_state[0] for i, s in enumerate(sequences)]


def test_decoder_hidden_states_equal_transformers_per_sequence(decoder_pair):
    hf, packed = decoder_pair
    assert isinstance(packed, PackedDecoder)
    sequences = random_sequences([7, 19, 1, 12])
    hidden = packed(pack(sequences))
    expected = torch.cat(per_sequence_hidden(hf, sequences))
    torch.testing.assert_close(hidden, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_decoder_forward_read_equals_full_forward_at_read_positions(decoder_pair):
    _, packed = decoder_pair
    batch = pack(random_sequences([9, 4, 15]))
    torch.testing.assert_close(packed.forward_read(batch), packed(batch)[batch.read_positions],
                               atol=TOLERANCE, rtol=TOLERANCE)


def test_decoder_heads_equal_transformers_logits(decoder_pair):
    hf, packed = decoder_pair
    sequences = random_sequences([6, 11], seed=2)
    read = packed.forward_read(pack(sequences))
    with torch.no_grad():
        logits = [hf(input_ids=torch.tensor([s])).logits[0] for s in sequences]
    # A CausalLM gives [S, vocab] per sequence; a SequenceClassification model has pooled its last token.
    expected = [rows[-1] if rows.dim() == 2 else rows for rows in logits]
    head = packed.score_weight if packed.score_weight is not None else packed.lm_head_weight
    torch.testing.assert_close(read @ head.T, torch.stack(expected), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_multi_item_batch_equals_per_pair_forwards(tmp_path, attention):
    hf = load_tiny(tmp_path, transformers.Qwen3ForCausalLM, DECODERS["qwen3"][1]())
    packed = build_packed_model(hf, attention_fn=ATTENTIONS[attention])
    prefix, *items = random_sequences([10, 5, 8, 3], seed=3)
    batch = pack_multi_item(prefix, items)
    hidden = packed(batch)
    pairs = per_sequence_hidden(hf, [prefix + item for item in items])
    expected = torch.cat([pair[len(prefix):] for pair in pairs])
    torch.testing.assert_close(hidden[len(prefix):], expected, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(packed.forward_read(batch), torch.stack([pair[-1] for pair in pairs]),
                               atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("name", ["qwen3", "llama3", "qwen2"])
def test_decoder_fused_qk_kernel_equals_torch_path(tmp_path, monkeypatch, name):
    """fused_qk=True (qk_norm_rope, in Triton's interpreter on the CPU) against the pure-torch path: Qwen3 with
    per-head q/k norms, Llama 3 (scaled rotary) and Qwen2 (qkv bias) without; plain and MIS packs."""
    from rerankit.kernels import qk_norm_rope as kernels

    forbid_reference(monkeypatch, kernels, "qk_norm_rope_reference")
    model_class, make_config = DECODERS[name]
    hf = load_tiny(tmp_path, model_class, make_config())
    fused = PackedDecoder(hf, attention_fn=dense_attention, fused_qk=True)
    plain = PackedDecoder(hf, attention_fn=dense_attention, fused_qk=False)
    assert fused.fused_qk and not plain.fused_qk
    assert (fused.layers[0].q_norm is not None) == (name == "qwen3")
    prefix, *items = random_sequences([10, 5, 8, 3], seed=5)
    for batch in (pack(random_sequences([7, 19, 1, 12])), pack_multi_item(prefix, items)):
        torch.testing.assert_close(fused(batch), plain(batch), atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(fused.forward_read(batch), plain.forward_read(batch), atol=TOLERANCE,
                                   rtol=TOLERANCE)
    plain.fused_qk = True  # the switch is an attribute too
    torch.testing.assert_close(plain(batch), fused(batch), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("name", ["qwen3", "llama3", "qwen2"])
def test_decoder_fused_qkv_rope_equals_torch_path(tmp_path, monkeypatch, name):
    """``fused_qkv_rope`` (the q/k/v GEMM with the q/k norm and rotary in its epilogue, in Triton's interpreter on
    the CPU; q, k and v are then strided views of its output) against the pure-torch path, plain and MIS packs."""
    from rerankit.kernels import qkv_rope_matmul as kernels

    forbid_reference(monkeypatch, kernels, "qkv_rope_matmul_reference")
    model_class, make_config = DECODERS[name]
    hf = load_tiny(tmp_path, model_class, make_config())
    fused = PackedDecoder(hf, attention_fn=dense_attention, fused_qk=True)
    plain = PackedDecoder(hf, attention_fn=dense_attention, fused_qk=False)
    assert not fused.fused_qkv_rope  # on GPUs with the copy engine only by default
    fused.fused_qkv_rope, fused.fused_qkv_rope_min_tokens = True, 0
    calls = []
    original = kernels.qkv_rope_matmul
    monkeypatch.setattr(kernels, "qkv_rope_matmul", lambda *args: calls.append(1) or original(*args))
    prefix, *items = random_sequences([10, 5, 8, 3], seed=8)
    for batch in (pack(random_sequences([7, 19, 1, 12])), pack_multi_item(prefix, items)):
        torch.testing.assert_close(fused(batch), plain(batch), atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(fused.forward_read(batch), plain.forward_read(batch), atol=TOLERANCE,
                                   rtol=TOLERANCE)
    assert len(calls) == 4 * len(fused.layers)
    fused.fused_qkv_rope_min_tokens = batch.num_tokens + 1  # smaller batches keep cuBLAS and the q/k kernel
    torch.testing.assert_close(fused(batch), plain(batch), atol=TOLERANCE, rtol=TOLERANCE)
    assert len(calls) == 4 * len(fused.layers)


def test_decoder_last_layer_attends_from_the_read_rows_only(tmp_path, monkeypatch):
    """In the last layer of ``forward_read`` the Triton attention computes only the read rows (``reads=``, in
    Triton's interpreter on the CPU); the read states equal those of the whole pack's attention, MIS and plain."""
    import functools

    from rerankit.kernels import prefix_attention as kernels

    if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        pytest.skip("triton was imported without its interpreter")
    hf = load_tiny(tmp_path, transformers.Qwen3ForCausalLM, DECODERS["qwen3"][1]())
    model = PackedDecoder(hf, attention_fn=functools.partial(packed_attention, backend="triton"))
    reference = PackedDecoder(hf, attention_fn=dense_attention)
    seen = []
    original = kernels.prefix_attention
    monkeypatch.setattr(kernels, "prefix_attention",
                        lambda *args, **kwargs: seen.append(kwargs.get("reads") is not None) or original(*args, **kwargs))
    monkeypatch.setattr(attention_module, "prefix_attention", kernels.prefix_attention)
    prefix, *items = random_sequences([10, 5, 8, 3], seed=9)
    for batch in (pack_multi_item(prefix, items), pack(random_sequences([7, 19, 1, 12]))):
        seen.clear()
        torch.testing.assert_close(model.forward_read(batch), reference.forward_read(batch), atol=TOLERANCE,
                                   rtol=TOLERANCE)
        assert seen == [False] * (len(model.layers) - 1) + [True]
        seen.clear()
        torch.testing.assert_close(model(batch), reference(batch), atol=TOLERANCE, rtol=TOLERANCE)
        assert not any(seen)  # every row wanted: no reads


def test_decoder_fused_qk_choice(tmp_path, monkeypatch):
    hf = load_tiny(tmp_path, transformers.Qwen3ForCausalLM, DECODERS["qwen3"][1]())
    monkeypatch.delenv("RERANKIT_FUSED_QK", raising=False)
    assert not PackedDecoder(hf).fused_qk  # default: on CUDA only, and these weights are on the CPU
    monkeypatch.setenv("RERANKIT_FUSED_QK", "1")
    assert PackedDecoder(hf).fused_qk
    assert not PackedDecoder(hf, fused_qk=False).fused_qk  # the argument wins over the environment
    monkeypatch.setenv("RERANKIT_FUSED_QK", "0")
    assert not PackedDecoder(hf).fused_qk
    assert PackedDecoder(hf, fused_qk=True).fused_qk
    monkeypatch.setenv("RERANKIT_FUSED_QK", "yes")
    with pytest.raises(ValueError, match="RERANKIT_FUSED_QK"):
        PackedDecoder(hf)


def test_decoder_fused_qk_runs_only_from_its_batch_size_when_chosen_automatically(tmp_path, monkeypatch):
    from rerankit.engine.models import decoder as decoder_module

    monkeypatch.delenv("RERANKIT_FUSED_QK", raising=False)
    hf = load_tiny(tmp_path, transformers.Qwen3ForCausalLM, DECODERS["qwen3"][1]())
    model = PackedDecoder(hf, attention_fn=dense_attention, fused_qk=True)
    assert model.fused_qk_min_tokens == 0  # chosen by the caller: every batch
    assert PackedDecoder(hf).fused_qk_min_tokens == decoder_module.FUSED_QK_MIN_TOKENS  # automatic
    calls = []
    original = model._fused_attention_inputs
    monkeypatch.setattr(model, "_fused_attention_inputs", lambda *args: calls.append(1) or original(*args))
    batch = pack(random_sequences([7, 19, 1, 12]))
    expected = model(batch)
    assert len(calls) == len(model.layers)
    model.fused_qk_min_tokens = batch.num_tokens + 1  # a smaller batch takes the compiled torch path
    torch.testing.assert_close(model(batch), expected, atol=TOLERANCE, rtol=TOLERANCE)
    assert len(calls) == len(model.layers)


def test_decoder_graphed_forward_takes_the_large_batch_steps_with_the_same_results(tmp_path, monkeypatch):
    """``graphed=True`` (a CUDA-graph capture) runs the fused q/k kernel and the residual projections behind
    ``residual_projection`` at any batch size; the hidden states equal the plain path's."""
    from rerankit.engine.models import decoder as decoder_module
    from rerankit.kernels import qk_norm_rope as kernels

    if not torch.cuda.is_available() and not kernels._INTERPRET:
        pytest.skip("triton was imported without its interpreter")
    monkeypatch.delenv("RERANKIT_FUSED_QK", raising=False)
    hf = load_tiny(tmp_path, transformers.Qwen2ForCausalLM, DECODERS["qwen2"][1]())  # biases on q/k/v
    model = PackedDecoder(hf, attention_fn=dense_attention)
    assert not model.unfused_residual  # on CUDA only by default
    model.fused_qk, model.fused_qk_min_tokens, model.unfused_residual = True, decoder_module.FUSED_QK_MIN_TOKENS, True
    steps = {"fused_qk": 0, "residual_projection": 0}
    original_inputs = model._fused_attention_inputs
    monkeypatch.setattr(model, "_fused_attention_inputs",
                        lambda *args: steps.__setitem__("fused_qk", steps["fused_qk"] + 1) or original_inputs(*args))
    original_projection = decoder_module.residual_projection
    monkeypatch.setattr(decoder_module, "residual_projection", lambda *args: steps.__setitem__(
        "residual_projection", steps["residual_projection"] + 1) or original_projection(*args))
    prefix, *items = random_sequences([10, 5, 8, 3], seed=6)
    batch = pack_multi_item(prefix, items)
    plain = model.forward_read(batch)
    assert steps == {"fused_qk": 0, "residual_projection": 0}  # a small eager batch: the fewest launches
    torch.testing.assert_close(model.forward_read(batch, graphed=True), plain, atol=TOLERANCE, rtol=TOLERANCE)
    assert steps == {"fused_qk": len(model.layers), "residual_projection": len(model.layers)}
    torch.testing.assert_close(model.forward(batch, graphed=True)[batch.read_positions], plain, atol=TOLERANCE,
                               rtol=TOLERANCE)


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])
def test_decoder_fused_swiglu_equals_the_compiled_mlp(tmp_path, monkeypatch, name):
    """``fused_swiglu`` (the gate/up GEMM with SwiGLU in its epilogue, in Triton's interpreter on the CPU, and the
    down projection added in place) against the plain MLP; it runs only where the large-batch steps run."""
    from rerankit.kernels import swiglu_matmul as kernels

    forbid_reference(monkeypatch, kernels, "swiglu_matmul_reference")
    model_class, make_config = DECODERS[name]
    hf = load_tiny(tmp_path, model_class, make_config())
    model = PackedDecoder(hf, attention_fn=dense_attention, fused_qk=False)
    assert not model.fused_swiglu  # on CUDA only by default
    assert PackedDecoder(hf, attention_fn=dense_attention, fused_qk=False, fused_swiglu=True).fused_swiglu
    prefix, *items = random_sequences([10, 5, 8, 3], seed=7)
    batch = pack_multi_item(prefix, items)
    plain_read, plain_all = model.forward_read(batch), model(batch)
    model.fused_swiglu = True
    calls = []
    original = kernels.swiglu_matmul
    monkeypatch.setattr(kernels, "swiglu_matmul", lambda *args: calls.append(1) or original(*args))
    torch.testing.assert_close(model.forward_read(batch), plain_read, atol=TOLERANCE, rtol=TOLERANCE)
    assert calls == []  # a small eager batch keeps the compiled step
    torch.testing.assert_close(model.forward_read(batch, graphed=True), plain_read, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(model(batch, graphed=True), plain_all, atol=TOLERANCE, rtol=TOLERANCE)
    assert len(calls) == 2 * len(model.layers)


def test_decoder_fused_qk_refuses_head_dims_the_kernel_lacks(tmp_path, monkeypatch):
    monkeypatch.delenv("RERANKIT_FUSED_QK", raising=False)
    config = transformers.Qwen3Config(**{**DECODER_SIZES, "num_attention_heads": 2, "num_key_value_heads": 1},
                                      head_dim=24)
    hf = load_tiny(tmp_path, transformers.Qwen3ForCausalLM, config)
    with pytest.raises(ValueError, match="power of two"):
        PackedDecoder(hf, fused_qk=True)
    assert not PackedDecoder(hf).fused_qk  # the default falls back to the torch path, on CUDA too


ENCODERS = {
    "bert": (transformers.BertModel, lambda: transformers.BertConfig(**ENCODER_SIZES)),
    "bert-seq-cls": (transformers.BertForSequenceClassification,
                     lambda: transformers.BertConfig(**ENCODER_SIZES, num_labels=2)),
    "xlm-roberta-seq-cls": (transformers.XLMRobertaForSequenceClassification,
                            lambda: transformers.XLMRobertaConfig(**ENCODER_SIZES, type_vocab_size=1, num_labels=1,
                                                                  pad_token_id=1)),
}


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_encoder_hidden_states_and_head_equal_transformers_per_sequence(tmp_path, name, attention):
    model_class, make_config = ENCODERS[name]
    hf = load_tiny(tmp_path, model_class, make_config())
    packed = build_packed_model(hf, attention_fn=ATTENTIONS[attention])
    assert isinstance(packed, PackedEncoder)
    sequences = random_sequences([8, 3, 13], seed=4)
    # A BERT pair: first segment 0, second segment 1; XLM-R has a single segment.
    types = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) if hf.config.type_vocab_size > 1 else [0] * len(s)
             for s in sequences]
    batch = pack(sequences, causal=False, token_types=types,
                 read_positions=torch.tensor([0, 8, 11]))
    hidden = packed(batch)
    expected = per_sequence_hidden(hf, sequences, token_type_ids=types)
    torch.testing.assert_close(hidden, torch.cat(expected), atol=TOLERANCE, rtol=TOLERANCE)
    cls = packed.forward_read(batch)
    torch.testing.assert_close(cls, torch.stack([e[0] for e in expected]), atol=TOLERANCE, rtol=TOLERANCE)
    if isinstance(hf, transformers.BertModel):
        with torch.no_grad():
            pooled = [hf(input_ids=torch.tensor([s]), token_type_ids=torch.tensor([t])).pooler_output[0]
                      for s, t in zip(sequences, types)]
        torch.testing.assert_close(packed.pool(cls), torch.stack(pooled), atol=TOLERANCE, rtol=TOLERANCE)
    else:
        with torch.no_grad():
            logits = [hf(input_ids=torch.tensor([s]), token_type_ids=torch.tensor([t])).logits[0]
                      for s, t in zip(sequences, types)]
        torch.testing.assert_close(packed.classify(cls), torch.stack(logits), atol=TOLERANCE, rtol=TOLERANCE)


def test_weights_are_shared_with_the_transformers_model(tmp_path):
    hf = load_tiny(tmp_path, transformers.Qwen2ForCausalLM, DECODERS["qwen2"][1]())
    packed = build_packed_model(hf, attention_fn=dense_attention)
    attn, layer = hf.model.layers[0].self_attn, packed.layers[0]
    assert packed.embed_weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert attn.q_proj.weight.untyped_storage().data_ptr() == layer.qkv_weight.untyped_storage().data_ptr()
    assert attn.v_proj.bias.untyped_storage().data_ptr() == layer.qkv_bias.untyped_storage().data_ptr()
    parameter_bytes = sum(p.numel() * p.element_size() for p in packed.parameters())
    assert parameter_bytes == sum(p.numel() * p.element_size() for p in hf.parameters())


def test_unsupported_architectures_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert build_packed_model(gpt2) is None
    assert not supports(gpt2.config)
    assert supports(transformers.Qwen3Config(**DECODER_SIZES))
    assert not supports(transformers.Qwen2Config(**DECODER_SIZES, use_sliding_window=True, sliding_window=16,
                                                 max_window_layers=0))
    assert not supports(transformers.LlamaConfig(**DECODER_SIZES, rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0)))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_bf16_gpu_forward_matches_transformers(tmp_path, compile):
    config = transformers.Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                       attn_implementation="sdpa").cuda().eval()
    packed = build_packed_model(hf, compile=compile)
    sequences = [torch.randint(0, 1024, (n,)).tolist() for n in (300, 17, 129, 64)]
    batch = pack(sequences).to("cuda")
    with torch.no_grad():
        expected = torch.cat([hf.model(input_ids=torch.tensor([s], device="cuda")).last_hidden_state[0]
                              for s in sequences]).float()
    outputs = [packed(batch), packed.forward_read(batch)]
    packed.fused_swiglu = True  # the large-batch steps (graphed=True) with the Triton SwiGLU GEMM
    outputs += [packed(batch, graphed=True), packed.forward_read(batch, graphed=True)]
    for hidden in outputs:
        reference = expected if hidden.shape[0] == expected.shape[0] else expected[batch.read_positions]
        error = (hidden.float() - reference).norm(dim=-1) / reference.norm(dim=-1)
        assert error.max() < 0.02, f"relative error up to {error.max():.4f} against transformers in bf16"
