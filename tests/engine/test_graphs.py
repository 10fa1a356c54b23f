"""CUDA graphs for small micro-batches: the padding a replay sees leaves every real row as it is (CPU, through
the Triton kernels' interpreter), the buckets, the option's checks; replays against eager runs on the GPU."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import transformers

from rerankit.engine import EmbeddedBackend
from rerankit.engine.attention import packed_attention
from rerankit.engine.graphs import (MAX_GRAPH_TOKENS, MIN_READS, TOKEN_BUCKETS, GraphCaptureError, GraphKey,
                                    empty_batch, graph_key, pad_batch)
from rerankit.engine.load import load_model
from rerankit.engine.models import build_packed_model
from rerankit.engine.runner import PackedRunner, make_runner
from rerankit.errors import InvalidRequest
from rerankit.schema import ScoreRequest
from test_fast_path import DOCS, QUERY, make_decoder
from test_models import (DECODERS, ENCODER_SIZES, TOLERANCE, load_tiny, pack, pack_multi_item,
                         random_sequences)

triton_attention = functools.partial(packed_attention, backend="triton")


def test_graph_keys_round_tokens_up_and_count_the_padding_sequence():
    batch = pack(random_sequences([7, 19, 1, 12]))  # 39 tokens, 4 sequences, 4 reads
    assert graph_key(batch, read=True) == GraphKey(256, 8, MIN_READS, True, False, True)
    many = pack(random_sequences([1] * (MIN_READS + 1)))  # reads past the minimum: the next power of two
    assert graph_key(many, read=True) == GraphKey(256, 2 * MIN_READS, 2 * MIN_READS, True, False, True)
    exact = pack(random_sequences([200, 56]))  # 256 tokens: no padding sequence; every token's rows: no reads
    assert graph_key(exact, read=False) == GraphKey(256, 2, 0, True, False, False)
    assert graph_key(pack(random_sequences([300, 1000])), read=True).tokens == 1536  # steps of 256 up to 2,048
    huge = pack(random_sequences([TOKEN_BUCKETS[-1] + 1]))
    assert graph_key(huge, read=True, max_tokens=10**9) is None
    large = pack(random_sequences([MAX_GRAPH_TOKENS + 1]))
    assert graph_key(large, read=True) is None  # eager above the default limit
    assert graph_key(large, read=True, max_tokens=16384).tokens == MAX_GRAPH_TOKENS + 1024


def test_batches_whose_queries_see_many_keys_get_graphs_of_their_own():
    """The attention tile is chosen from ``keys_per_query`` when the graph is captured: a batch past the long-keys
    threshold gets a key (and an empty capture batch) that picks the long-keys tile."""
    from rerankit.kernels.attention_config import CUDA_LONG_KEYS_CONFIG, LONG_KEYS_PER_QUERY, default_config

    short = pack(random_sequences([7, 19, 1, 12]))
    long = dataclasses.replace(short, keys_per_query=float(LONG_KEYS_PER_QUERY))
    assert not graph_key(short, read=True).long_keys
    key = graph_key(long, read=True)
    assert key.long_keys and key == dataclasses.replace(graph_key(short, read=True), long_keys=True)
    captured = empty_batch(key, torch.device("cpu"))
    assert default_config(torch.device("cuda"), True, captured.keys_per_query) == CUDA_LONG_KEYS_CONFIG
    assert empty_batch(graph_key(short, read=True), torch.device("cpu")).keys_per_query == 0.0
    bidirectional = dataclasses.replace(long, causal=False)
    assert not graph_key(bidirectional, read=True).long_keys  # encoders have one tile


def test_padded_forward_of_every_token_needs_no_read_buffer(tmp_path):
    hf = load_tiny(tmp_path, transformers.Qwen3ForCausalLM, DECODERS["qwen3"][1]())
    model = build_packed_model(hf, attention_fn=triton_attention)
    batch = pack(random_sequences([7, 19, 1, 12]))
    padded = pad_batch(batch, GraphKey(batch.num_tokens + 3, 8, 0, True, False, False))
    assert padded.read_positions.numel() == 0
    torch.testing.assert_close(model(padded)[:batch.num_tokens], model(batch), atol=TOLERANCE, rtol=TOLERANCE)


def test_a_failed_capture_falls_back_to_eager_launches_for_good(tmp_path, caplog):
    """A capture that fails (out of memory, an operation that cannot be captured) costs that batch nothing: it
    runs eagerly, and so does every later one, with one warning."""
    loaded = load_model(str(make_decoder(tmp_path, "lm")), device="cpu")
    runner = make_runner(loaded, "packed")
    assert isinstance(runner, PackedRunner) and runner.graphs is None  # no graphs on the CPU by default

    class FailingGraphs:
        calls = 0

        def run(self, batch, read, cached_kv=None):
            FailingGraphs.calls += 1
            raise GraphCaptureError("capturing the forward of GraphKey(...) failed: out of memory")

    batch = pack([[token % loaded.vocab_size for token in sequence] for sequence in random_sequences([7, 19, 1, 12])])
    expected = runner.forward_read(batch)
    runner.graphs = FailingGraphs()
    with caplog.at_level("WARNING", logger="rerankit.engine"):
        torch.testing.assert_close(runner.forward_read(batch), expected)
        torch.testing.assert_close(runner.forward_read(batch), expected)
    assert runner.graphs is None and FailingGraphs.calls == 1
    assert [record.message for record in caplog.records] == [
        "capturing the forward of GraphKey(...) failed: out of memory; rerankit runs this model without CUDA graphs "
        "from now on"]


@pytest.mark.parametrize("layout", ["pairs", "multi-item"])
def test_padded_decoder_batch_keeps_every_real_row(tmp_path, layout):
    hf = load_tiny(tmp_path, transformers.Qwen3ForCausalLM, DECODERS["qwen3"][1]())
    model = build_packed_model(hf, attention_fn=triton_attention)
    if layout == "pairs":
        batch = pack(random_sequences([7, 19, 1, 12]))
    else:
        prefix, *items = random_sequences([10, 5, 8, 3, 1], seed=4)
        batch = pack_multi_item(prefix, items)
    read, every_token = model.forward_read(batch), model(batch)  # the unpadded batch's rows, for both keys
    # Small keys keep the interpreter quick: padding tokens in a sequence of their own, and none (exact fit).
    for key in (GraphKey(batch.num_tokens + 5, 8, 8, True, False, True),
                GraphKey(batch.num_tokens, 8, 8, True, False, True)):
        padded = pad_batch(batch, key)
        assert padded.num_tokens == key.tokens and padded.max_seqlen == key.tokens
        torch.testing.assert_close(model.forward_read(padded)[:batch.read_positions.numel()], read,
                                   atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(model(padded)[:batch.num_tokens], every_token, atol=TOLERANCE, rtol=TOLERANCE)


def test_padded_batch_with_a_kept_head_keeps_every_real_row(tmp_path):
    """A batch whose sequence begins with a kept head: read from a slot of more rows than the head (as a graph reads
    it), padded, it scores as the whole prefix computed inline."""
    import numpy as np

    from rerankit.engine.plan import plan_requests, RequestParts
    from rerankit.engine.prefix_cache import CachedKV

    hf = load_tiny(tmp_path, transformers.Qwen3ForCausalLM, DECODERS["qwen3"][1]())
    model = build_packed_model(hf, attention_fn=triton_attention)
    head, prefix, *items = (np.array(ids) for ids in random_sequences([12, 3, 5, 1, 7], seed=5))

    def planned(parts):
        [micro] = plan_requests([parts], 4096, padded=False, causal=True)
        return micro.batch

    suffix = np.array([9, 9])
    whole = planned(RequestParts(np.concatenate([head, prefix]), items, suffix, share_prefix=True))
    batch = planned(RequestParts(prefix, items, suffix, share_prefix=True, cached_head=head))
    expected = model.forward_read(whole)
    kept = model.keep_prefix(pack([head.tolist()]))
    torch.testing.assert_close(model.forward_read(batch, cached_kv=kept), expected, atol=TOLERANCE, rtol=TOLERANCE)
    key = graph_key(batch, read=True)
    assert key.kept == 256 and empty_batch(key, torch.device("cpu")).cached_lens.tolist() == [0] * key.sequences
    slot = CachedKV(*([torch.cat([x, torch.full((key.kept - len(head), *x.shape[1:]), 7.0)]) for x in part]
                      for part in (kept.keys, kept.values)))  # rows past the head are never read
    padded = pad_batch(batch, dataclasses.replace(key, tokens=batch.num_tokens + 5, sequences=2))
    assert padded.cached_lens.tolist() == [12, 0]
    torch.testing.assert_close(model.forward_read(padded, cached_kv=slot)[:len(items)], expected, atol=TOLERANCE,
                               rtol=TOLERANCE)


def test_padded_encoder_batch_keeps_every_real_row(tmp_path):
    config = transformers.BertConfig(**ENCODER_SIZES, type_vocab_size=2)
    hf = load_tiny(tmp_path, transformers.BertModel, config)
    model = build_packed_model(hf, attention_fn=triton_attention)
    sequences = random_sequences([9, 4, 15])
    types = [[0] * 3 + [1] * (len(sequence) - 3) for sequence in sequences]
    batch = pack(sequences, causal=False, token_types=types, read_positions=torch.tensor([0, 9, 13]))
    padded = pad_batch(batch, GraphKey(batch.num_tokens + 7, 4, 4, False, True, False))
    torch.testing.assert_close(model(padded)[:batch.num_tokens], model(batch), atol=TOLERANCE, rtol=TOLERANCE)


def test_cuda_graphs_need_the_packed_runner_on_a_gpu(tmp_path):
    path = make_decoder(tmp_path / "lm", "lm")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequest, match="cuda_graphs"):
            EmbeddedBackend(str(path), device="cpu", cuda_graphs=True)
        return
    with pytest.raises(InvalidRequest, match="cuda_graphs"):
        make_runner(load_model(str(path), device="cuda"), "reference", cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_graph_replays_score_as_eager_runs(tmp_path, dtype):
    path = make_decoder(tmp_path / "lm", "lm")
    eager = EmbeddedBackend(str(path), device="cuda", dtype=dtype)
    graphed = EmbeddedBackend(str(path), device="cuda", dtype=dtype, cuda_graphs=True)
    requests = [ScoreRequest(query=QUERY, items=DOCS, template="qwen3-reranker"),
                ScoreRequest(query=QUERY, items=DOCS[:3], template="qwen3-reranker", multi_item=False),
                ScoreRequest(query=QUERY, items=[doc + " more words" for doc in DOCS], template="qwen3-reranker")]
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    for _ in range(2):
        for request in requests:
            torch.testing.assert_close(torch.tensor(graphed.score(request).scores),
                                       torch.tensor(eager.score(request).scores), atol=tolerance, rtol=0)
    captures = graphed._runner.graphs.captures
    assert 1 <= captures <= len(requests)  # the second round replays the shapes the first one captured
