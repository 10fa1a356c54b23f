import os
import random
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend runs in the interpreter on CPU

from rerankit.engine import attention  # noqa: E402
from rerankit.engine.attention import available_backends, packed_attention  # noqa: E402
from rerankit.engine.batch import PackedBatch, attention_allowed  # noqa: E402


def make_batch(layout, causal=True, device="cpu"):
    """A PackedBatch for ``layout``: one (prefix_len, item_lens) per sequence; (0, [n]) is a plain sequence."""
    cu, prefix_lens, span_starts, positions, read_positions = [0], [], [], [], []
    for prefix_len, item_lens in layout:
        seq_start = cu[-1]
        span_starts += [seq_start] * prefix_len
        positions += list(range(prefix_len))
        item_start = seq_start + prefix_len
        for item_len in item_lens:
            span_starts += [item_start] * item_len
            positions += list(range(prefix_len, prefix_len + item_len))
            item_start += item_len
            read_positions.append(item_start - 1)
        cu.append(item_start)
        prefix_lens.append(prefix_len)
    total = cu[-1]
    as_long = dict(dtype=torch.int64, device=device)
    as_int = dict(dtype=torch.int32, device=device)
    return PackedBatch(
        input_ids=torch.zeros(total, **as_long),
        position_ids=torch.tensor(positions, **as_long),
        cu_seqlens=torch.tensor(cu, **as_int),
        max_seqlen=max(end - start for start, end in zip(cu[:-1], cu[1:])),
        prefix_lens=torch.tensor(prefix_lens, **as_int),
        span_starts=torch.tensor(span_starts, **as_int),
        read_positions=torch.tensor(read_positions, **as_long),
        causal=causal,
    )


def random_qkv(total, q_heads, kv_heads, head_dim, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    shapes = [(total, q_heads, head_dim), (total, kv_heads, head_dim), (total, kv_heads, head_dim)]
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes]


def dense_reference(q, k, v, batch, scale):
    """Softmax attention over the whole pack with the dense mask of ``attention_allowed``, in float32."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~attention_allowed(batch), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


LAYOUTS = {
    "plain": ([(0, [9]), (0, [40]), (0, [1]), (0, [23])], True),
    "mis": ([(12, [5, 1, 9, 1, 20]), (0, [17]), (30, [40]), (3, [1, 1, 1])], True),
    "bidirectional": ([(0, [9]), (0, [40]), (0, [1])], False),
}


@pytest.mark.parametrize("backend", [b for b in available_backends("cpu") if b != "varlen"])
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_backend_matches_dense_mask_reference(backend, layout_name):
    layout, causal = LAYOUTS[layout_name]
    batch = make_batch(layout, causal)
    q, k, v = random_qkv(batch.num_tokens, 4, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        got = packed_attention(q, k, v, batch, scale=0.25, backend=backend)
    torch.testing.assert_close(got, dense_reference(q, k, v, batch, 0.25), atol=1e-4, rtol=1e-4)


def random_layout(rng: random.Random, causal: bool) -> list[tuple[int, list[int]]]:
    """Plain sequences and (when causal) MIS sequences of ragged prefixes and spans, length-1 ones included."""
    layout = []
    for _ in range(rng.randint(1, 6)):
        if causal and rng.random() < 0.6:
            spans = [rng.choice([1, rng.randint(1, 8), rng.randint(9, 40)]) for _ in range(rng.randint(1, 12))]
            layout.append((rng.choice([1, rng.randint(2, 30)]), spans))
        else:
            layout.append((0, [rng.choice([1, rng.randint(2, 50)])]))
    return layout


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("max_span_keys", [attention.MAX_SPAN_KEYS, 40])
def test_sdpa_spans_match_the_dense_mask_on_ragged_packs(monkeypatch, causal, max_span_keys):
    monkeypatch.setattr(attention, "MAX_SPAN_KEYS", max_span_keys)  # 40 splits the groups further
    rng = random.Random(int(causal) + max_span_keys)
    for _ in range(12):
        batch = make_batch(random_layout(rng, causal), causal)
        q, k, v = random_qkv(batch.num_tokens, 4, 2, 16)
        got = packed_attention(q, k, v, batch, scale=0.25, backend="sdpa")
        torch.testing.assert_close(got, dense_reference(q, k, v, batch, 0.25), atol=1e-5, rtol=1e-5)


def test_sdpa_gives_each_span_its_prefix_and_its_own_keys_only():
    prefix, spans = 80, [30 + 9 * i % 91 for i in range(50)]
    batch = make_batch([(prefix, spans), (0, [120])])
    groups = attention.span_groups(batch)
    assert sorted(torch.cat([group.targets for group in groups]).tolist()) == list(range(batch.num_tokens))
    for group in groups:
        count, width = group.queries.shape
        assert group.keys.shape[1] <= prefix + width and width <= max(spans)
        assert group.queries.min() >= 0 and group.queries.max() < batch.num_tokens
    padded_keys = sum(group.keys.numel() for group in groups)
    assert padded_keys < 1.3 * (len(spans) * prefix + sum(spans) + prefix + 120)
    assert len(groups) < 10


def test_block_mask_is_built_once_per_batch(monkeypatch):
    built = []

    def counting_build(batch):
        built.append(batch)
        return build_block_mask(batch)

    build_block_mask = attention.build_block_mask
    monkeypatch.setattr(attention, "build_block_mask", counting_build)
    batch = make_batch(LAYOUTS["mis"][0])
    q, k, v = random_qkv(batch.num_tokens, 2, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _layer in range(3):
            packed_attention(q, k, v, batch, backend="flex")
        packed_attention(q, k, v, make_batch(LAYOUTS["mis"][0]), backend="flex")
    assert len(built) == 2


def test_a_gone_batchs_masks_are_dropped_by_the_next_batch():
    batch = make_batch(LAYOUTS["mis"][0])
    q, k, v = random_qkv(batch.num_tokens, 2, 2, 16)
    packed_attention(q, k, v, batch, backend="sdpa")
    assert attention._batch_state(batch).span_groups is not None
    del batch
    other = make_batch(LAYOUTS["mis"][0])
    packed_attention(q, k, v, other, backend="sdpa")
    assert all(ref() is not None for ref, _ in attention._STATES.values())


def test_varlen_refuses_multi_item_batches():
    batch = make_batch(LAYOUTS["mis"][0])
    q, k, v = random_qkv(batch.num_tokens, 2, 2, 16)
    with pytest.raises(ValueError, match="shared-prefix"):
        packed_attention(q, k, v, batch, backend="varlen")


def test_unknown_backend_is_refused():
    batch = make_batch(LAYOUTS["plain"][0])
    q, k, v = random_qkv(batch.num_tokens, 2, 2, 16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        packed_attention(q, k, v, batch, backend="xformers")


def test_cpu_default_is_sdpa():
    assert attention.default_backend("cpu") == "sdpa"


GPU_LAYOUTS = {
    "w1-plain": ([(0, [76 + n]) for n in (64, 447, 200, 130, 1, 300, 96)], True),
    "mis-prefix-76": ([(76, [64 + 37 * i % 384 for i in range(12)] + [1])], True),
    "mis-mixed": ([(300, [128] * 6), (0, [200]), (5, [1, 1, 400])], True),
    "encoder": ([(0, [n]) for n in (512, 33, 1, 260)], False),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "flex", "varlen", "sdpa"])
@pytest.mark.parametrize("layout_name", GPU_LAYOUTS)
def test_backend_matches_dense_mask_reference_on_gpu_bf16(backend, layout_name):
    layout, causal = GPU_LAYOUTS[layout_name]
    batch = make_batch(layout, causal, device="cuda")
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available in this torch")
    if backend == "varlen" and batch.is_multi_item:
        pytest.skip("varlen has no shared-prefix mask")
    q, k, v = random_qkv(batch.num_tokens, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    got = packed_attention(q, k, v, batch, backend=backend)
    expected = dense_reference(q, k, v, batch, 128**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
