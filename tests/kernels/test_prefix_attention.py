import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's import

from rerankit.kernels.attention_config import (  # noqa: E402
    CONFIG_ENV,
    CPU_DEFAULT_CONFIG,
    CUDA_DEFAULT_CONFIG,
    CUDA_LONG_KEYS_CONFIG,
    CUDA_WIDE_GROUP_CONFIG,
    LONG_KEYS_PER_QUERY,
    AttentionConfig,
    default_config,
    parse_config,
)
from rerankit.kernels.prefix_attention import prefix_attention, prefix_attention_reference  # noqa: E402
from rerankit.kernels.prefix_attention_ws import takes_ws  # noqa: E402
from packs import pack_meta  # noqa: E402

TRITON_LONG_KEYS_CONFIG = dataclasses.replace(CUDA_LONG_KEYS_CONFIG, warp_specialized=False)


def random_qkv(total, q_heads, kv_heads, head_dim, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(total, q_heads, head_dim), (total, kv_heads, head_dim), (total, kv_heads, head_dim)]
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes]


def projection_views(q, k, v):
    """q, k and v as views of one [T, (Hq + 2 Hkv) D] projection, the way the decoder's q/k/v GEMM leaves them."""
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    parts = fused.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    return [part.unflatten(1, x.shape[1:]) for part, x in zip(parts, (q, k, v))]


def make_pack(layout, q_heads, kv_heads, head_dim, dtype=torch.float32, device="cpu", seed=0):
    meta = pack_meta(layout, device)
    total = int(meta["cu_seqlens"][-1])
    return random_qkv(total, q_heads, kv_heads, head_dim, dtype, device, seed), meta


PLAIN = [(0, [7]), (0, [33]), (0, [1]), (0, [50])]
MIS_RAGGED = [(12, [5, 1, 9, 1, 20]), (0, [17]), (30, [40]), (3, [1, 1, 1])]
LONG_PREFIX = [(45, [1, 30, 2, 16]), (0, [2])]

# None: the CPU default (one query head per program). Packed GQA: all query heads of a kv head per program, with
# block_n below and above block_m so the full-tile bounds are exercised both ways.
CONFIGS = [
    None,
    AttentionConfig(block_m=16, block_n=32, num_warps=1, num_stages=1, pack_gqa=True),
    AttentionConfig(block_m=32, block_n=16, num_warps=1, num_stages=1, pack_gqa=True),
    AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, pack_gqa=True, tma=True),
    AttentionConfig(block_m=32, block_n=16, num_warps=1, num_stages=1, tma=True),
]
CONFIG_IDS = ["unpacked", "packed-m16-n32", "packed-m32-n16", "packed-tma", "unpacked-tma"]
with_configs = pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)


@with_configs
@pytest.mark.parametrize(
    "layout, causal, q_heads, kv_heads, head_dim",
    [
        (PLAIN, True, 4, 2, 16),
        (MIS_RAGGED, True, 4, 2, 16),
        (MIS_RAGGED, True, 2, 2, 32),
        (MIS_RAGGED, True, 4, 1, 16),
        (LONG_PREFIX, True, 4, 2, 32),
        (LONG_PREFIX, True, 6, 2, 16),
        (PLAIN, False, 4, 2, 16),
        (MIS_RAGGED, False, 4, 1, 16),
    ],
    ids=["plain-causal-gqa", "mis-ragged-gqa", "mis-ragged-mha-d32", "mis-ragged-group4", "long-prefix-d32",
         "long-prefix-group3", "bidirectional", "bidirectional-group4"],
)
def test_kernel_matches_reference(layout, causal, q_heads, kv_heads, head_dim, config):
    (q, k, v), meta = make_pack(layout, q_heads, kv_heads, head_dim)
    expected = prefix_attention_reference(q, k, v, **meta, causal=causal)
    got = prefix_attention(q, k, v, **meta, causal=causal, config=config)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@with_configs
def test_kernel_honours_scale_and_strided_inputs(config):
    (q, k, v), meta = make_pack(MIS_RAGGED, 4, 2, 16, seed=1)
    q_view, k_view, v_view = projection_views(q, k, v)
    expected = prefix_attention_reference(q, k, v, **meta, scale=0.3)
    got = prefix_attention(q_view, k_view, v_view, **meta, scale=0.3, config=config)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@with_configs
def test_mis_item_equals_its_own_sequence(config):
    prefix_len, item_lens = 10, [6, 1, 13]
    (q, k, v), meta = make_pack([(prefix_len, item_lens)], 2, 1, 16, seed=2)
    shared = prefix_attention(q, k, v, **meta, config=config)
    item_start = prefix_len
    for item_len in item_lens:
        rows = list(range(prefix_len)) + list(range(item_start, item_start + item_len))
        alone = prefix_attention(q[rows], k[rows], v[rows], **pack_meta([(0, [len(rows)])]), config=config)
        torch.testing.assert_close(shared[item_start:item_start + item_len], alone[prefix_len:], atol=1e-5, rtol=1e-5)
        item_start += item_len


def cached_pack(layout, cached_len, cached_seqs, q_heads, kv_heads, head_dim, dtype=torch.float32, device="cpu",
                seed=0):
    """A pack whose sequences ``cached_seqs`` begin with the same ``cached_len`` prefix tokens, and the same pack with
    those tokens left out and kept as cached keys: (full q/k/v and meta, kept rows of the full pack, reduced q/k/v,
    reduced meta, cached)."""
    (q, k, v), meta = make_pack(layout, q_heads, kv_heads, head_dim, dtype, device, seed)
    starts = meta["cu_seqlens"].tolist()
    head = slice(starts[cached_seqs[0]], starts[cached_seqs[0]] + cached_len)
    for seq in cached_seqs[1:]:  # one cached head shared by the sequences that use it, as the planner makes it
        for x in (q, k, v):
            x[starts[seq]:starts[seq] + cached_len] = x[head]
    kept, reduced = [], []
    for seq, (prefix_len, items) in enumerate(layout):
        cut = cached_len if seq in cached_seqs else 0
        kept += range(starts[seq] + cut, starts[seq + 1])
        reduced.append((prefix_len - cut, items))
    cached = (torch.tensor([cached_len if seq in cached_seqs else 0 for seq in range(len(layout))],
                           dtype=torch.int32, device=device), k[head].clone(), v[head].clone())
    return (q, k, v), meta, kept, [x[kept] for x in (q, k, v)], pack_meta(reduced, device), cached


CACHED_LAYOUTS = [([(40, [5, 1, 19]), (0, [17]), (40, [2, 30])], 37, [0, 2]),
                  ([(23, [9, 9, 1]), (6, [4])], 23, [0]),
                  ([(50, [3, 12])], 16, [0])]


@with_configs
@pytest.mark.parametrize("layout, cached_len, cached_seqs", CACHED_LAYOUTS, ids=["two-cached", "all-prefix", "tile"])
def test_cached_prefix_keys_equal_the_whole_sequence(layout, cached_len, cached_seqs, config):
    (q, k, v), meta, kept, reduced_qkv, reduced_meta, cached = cached_pack(layout, cached_len, cached_seqs, 4, 2, 16)
    whole = prefix_attention_reference(q, k, v, **meta)[kept]
    torch.testing.assert_close(prefix_attention_reference(*reduced_qkv, **reduced_meta, cached=cached), whole,
                               atol=1e-5, rtol=1e-5)
    got = prefix_attention(*reduced_qkv, **reduced_meta, config=config, cached=cached)
    torch.testing.assert_close(got, whole, atol=1e-4, rtol=1e-4)


READ_CASES = [(PLAIN, True, 4, 2, 16), (MIS_RAGGED, True, 6, 2, 16), (LONG_PREFIX, True, 4, 4, 32),
              (MIS_RAGGED, False, 4, 1, 16)]


@pytest.mark.parametrize("config", [None, CONFIGS[3]], ids=["cpu-default", "packed-tma"])
@pytest.mark.parametrize("layout, causal, q_heads, kv_heads, head_dim", READ_CASES,
                         ids=["plain", "mis-group3", "long-prefix-mha-d32", "bidirectional-group4"])
def test_read_rows_equal_the_full_kernels_rows(layout, causal, q_heads, kv_heads, head_dim, config):
    """``reads=``: each read token's rows alone (one program each, its sequence found by binary search) equal the
    whole pack's rows there: each sequence's first and last token and every sixth one, in a shuffled order (the
    interpreter runs a program a read), then a repeated few, as graphs pad reads."""
    (q, k, v), meta = make_pack(layout, q_heads, kv_heads, head_dim, seed=4)
    whole = prefix_attention(q, k, v, **meta, causal=causal, config=config)
    bounds = meta["cu_seqlens"].tolist()
    tokens = sorted(set(range(0, q.shape[0], 6)) | set(bounds[:-1]) | {end - 1 for end in bounds[1:]})
    shuffled = torch.tensor(tokens)[torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0))]
    for reads in (shuffled, torch.tensor([0, 0, 5])):
        got = prefix_attention(q, k, v, **meta, causal=causal, config=config, reads=reads)
        assert got.shape == (len(reads), q_heads, head_dim)
        torch.testing.assert_close(got, whole[reads], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [None, CONFIGS[1], CONFIGS[3]], ids=["unpacked", "packed", "packed-tma"])
@pytest.mark.parametrize("reads", [None, [3, 0, 17, 17]], ids=["all-rows", "reads"])
def test_fp8_output_is_the_bounded_quantization_of_the_output(config, reads):
    """``fp8_bound`` (the largest |v|, which bounds every output: a row is a convex combination of v rows): the
    kernel writes the e4m3 codes of its own output under the one scale bound / 448 (``quantize_bounded``'s, bit
    for bit) and that scale for each row, for every kernel (all rows, packed heads, read rows)."""
    from rerankit.kernels.fp8_quant import FP8_DTYPE, abs_max_reference, quantize_bounded_reference

    (q, k, v), meta = make_pack(MIS_RAGGED, 4, 2, 16, seed=5)
    whole = prefix_attention(q, k, v, **meta, config=config)
    bound = abs_max_reference(v)
    assert (whole.abs() <= bound).all()
    chosen = None if reads is None else torch.tensor(reads)
    codes, scales = prefix_attention(q, k, v, **meta, config=config, reads=chosen, fp8_bound=bound)
    rows = whole if chosen is None else whole[chosen]
    expected_codes, expected_scales = quantize_bounded_reference(rows.flatten(1), bound)
    assert codes.dtype == FP8_DTYPE and codes.shape == rows.shape
    assert torch.equal(scales, expected_scales)
    assert torch.equal(codes.flatten(1).float(), expected_codes.float())


def test_read_rows_with_cached_keys_and_empty_sequences():
    """Reads of sequences that begin with kept keys, and a pack with empty sequences (a graph's padding)."""
    layout, cached_len, cached_seqs = CACHED_LAYOUTS[0]
    (q, k, v), meta, kept, reduced_qkv, reduced_meta, cached = cached_pack(layout, cached_len, cached_seqs, 4, 2, 16)
    whole = prefix_attention(*reduced_qkv, **reduced_meta, cached=cached)
    reads = torch.tensor([3, 0, len(kept) - 1, 20])
    got = prefix_attention(*reduced_qkv, **reduced_meta, cached=cached, reads=reads)
    torch.testing.assert_close(got, whole[reads], atol=1e-5, rtol=1e-5)
    (q, k, v), meta = make_pack([(0, [0]), (4, [3, 2]), (0, [0]), (0, [0]), (0, [6])], 4, 2, 16, seed=5)
    reads = torch.arange(q.shape[0])
    torch.testing.assert_close(prefix_attention(q, k, v, **meta, reads=reads), prefix_attention(q, k, v, **meta),
                               atol=1e-5, rtol=1e-5)


def test_packed_and_unpacked_agree_on_every_head():
    # Group 3 pads the packed tile to 4 heads per kv head: the padding rows must never be stored.
    (q, k, v), meta = make_pack(MIS_RAGGED, 6, 2, 16, seed=3)
    unpacked = prefix_attention(q, k, v, **meta, config=CPU_DEFAULT_CONFIG)
    packed = prefix_attention(q, k, v, **meta, config=AttentionConfig(16, 16, 1, 1, pack_gqa=True))
    torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=1e-5)


def test_tma_takes_the_projection_layout_and_falls_back_elsewhere():
    from rerankit.kernels.prefix_attention import takes_tma

    (q, k, v), meta = make_pack(MIS_RAGGED, 4, 2, 16, seed=5)
    assert takes_tma(k, v)  # [T, H, D] with each token's heads side by side
    k_strided = torch.randn(k.shape[0], k.shape[2], k.shape[1]).transpose(1, 2)  # heads apart: pointers
    assert not takes_tma(k_strided, v)
    expected = prefix_attention_reference(q, k_strided, v, **meta)
    config = AttentionConfig(16, 16, 1, 1, pack_gqa=True, tma=True)
    torch.testing.assert_close(prefix_attention(q, k_strided, v, **meta, config=config), expected,
                               atol=1e-4, rtol=1e-4)


def test_parse_config():
    assert parse_config("") == CUDA_DEFAULT_CONFIG
    assert parse_config("pack_gqa=1, block_m=64,block_n=64,num_warps=4,num_stages=3") == AttentionConfig(
        block_m=64, block_n=64, num_warps=4, num_stages=3, pack_gqa=True, tma=True)
    assert parse_config("pack_gqa=false", AttentionConfig(pack_gqa=True)) == AttentionConfig()
    assert parse_config("block_n=64", CPU_DEFAULT_CONFIG) == AttentionConfig(32, 64, 1, 1)
    assert parse_config("tma=yes", CPU_DEFAULT_CONFIG) == AttentionConfig(32, 16, 1, 1, tma=True)
    assert parse_config("maxnreg=168", CPU_DEFAULT_CONFIG) == AttentionConfig(32, 16, 1, 1, maxnreg=168)
    assert parse_config("maxnreg=0", CUDA_LONG_KEYS_CONFIG).maxnreg is None
    assert parse_config("warp_specialized=0", CUDA_LONG_KEYS_CONFIG) == dataclasses.replace(
        CUDA_LONG_KEYS_CONFIG, warp_specialized=False)
    for bad in ("block_m", "blockm=64", "block_m=sixty", "pack_gqa=maybe", "tma=2", "block_m=48", "num_stages=0",
                "maxnreg=300", "maxnreg=many"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_default_config_reads_the_environment(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert default_config(cpu) == default_config(cpu, keys_per_query=5000) == CPU_DEFAULT_CONFIG
    assert default_config(cuda) == CUDA_DEFAULT_CONFIG == AttentionConfig(32, 32, 4, 2, pack_gqa=True, tma=True)
    # Four query heads a kv head (4B/8B) take 16-token tiles, 64 rows as two heads' 32 tokens; eight take them too.
    assert default_config(cuda, group=2) == CUDA_DEFAULT_CONFIG
    assert default_config(cuda, group=4) == default_config(cuda, True, 100.0, 8) == AttentionConfig(
        16, 32, 4, 3, pack_gqa=True, tma=True)
    assert default_config(cuda, keys_per_query=LONG_KEYS_PER_QUERY, group=4) == CUDA_LONG_KEYS_CONFIG
    assert default_config(cuda, causal=False, group=4).block_m == 64
    # Queries that see many keys (long prefixes, long documents) get the larger tile.
    assert default_config(cuda, keys_per_query=LONG_KEYS_PER_QUERY - 1) == CUDA_DEFAULT_CONFIG
    assert default_config(cuda, keys_per_query=LONG_KEYS_PER_QUERY) == CUDA_LONG_KEYS_CONFIG == AttentionConfig(
        64, 64, 8, 2, pack_gqa=True, tma=True, maxnreg=128, warp_specialized=True)
    assert default_config(cuda, causal=False) == default_config(cuda, False, 5000) == AttentionConfig(
        64, 32, 4, 3, pack_gqa=True)
    monkeypatch.setenv(CONFIG_ENV, "pack_gqa=0,block_m=128,num_warps=4,num_stages=3,tma=0")
    assert default_config(cuda) == AttentionConfig(block_m=128, block_n=32)
    assert default_config(cuda, keys_per_query=5000) == AttentionConfig(128, 64, 4, 3, maxnreg=128,
                                                                        warp_specialized=True)
    monkeypatch.setenv(CONFIG_ENV, "pack_gqa=1,block_m=64,block_n=64,maxnreg=none")
    assert default_config(cuda) == AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, pack_gqa=True,
                                                   tma=True)
    assert default_config(cuda, keys_per_query=5000) == AttentionConfig(64, 64, 8, 2, pack_gqa=True, tma=True,
                                                                        warp_specialized=True)
    assert default_config(cpu) == AttentionConfig(64, 64, 1, 1, pack_gqa=True)
    monkeypatch.setenv(CONFIG_ENV, "pack_gqa=1,block_m=16,block_n=16")
    (q, k, v), meta = make_pack(LONG_PREFIX, 4, 2, 16, seed=4)
    torch.testing.assert_close(prefix_attention(q, k, v, **meta), prefix_attention_reference(q, k, v, **meta),
                               atol=1e-4, rtol=1e-4)
    monkeypatch.setenv(CONFIG_ENV, "block_m=12")
    with pytest.raises(ValueError, match=CONFIG_ENV):
        default_config(cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "config",
    [None, CUDA_LONG_KEYS_CONFIG, TRITON_LONG_KEYS_CONFIG, AttentionConfig(64, 64, 4, 3, pack_gqa=True),
     AttentionConfig(64, 32, 8, 3, pack_gqa=True, tma=True)],
    ids=["default", "long-keys", "long-keys-triton", "packed-m64-n64", "packed-m64-n32-w8-tma"],
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    "layout",
    [
        [(0, [76 + n]) for n in (64, 447, 200, 130, 1, 300)],
        [(76, [64 + 37 * i % 384 for i in range(20)] + [1])],
        [(1024, [128] * 12), (0, [500]), (5, [1, 1, 700])],
    ],
    ids=["w1-plain", "mis-prefix-76", "mis-prefix-1024-mixed"],
)
def test_kernel_matches_reference_on_gpu_bf16(layout, head_dim, config):
    (q, k, v), meta = make_pack(layout, 16, 8, head_dim, dtype=torch.bfloat16, device="cuda")
    expected = prefix_attention_reference(q.float(), k.float(), v.float(), **meta)
    got = prefix_attention(q, k, v, **meta, config=config)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", [[(0, [76 + n]) for n in (64, 447, 200, 130, 1, 300)],
                                    [(76, [64 + 37 * i % 384 for i in range(20)] + [1])]],
                         ids=["w1-plain", "mis-prefix-76"])
def test_wide_group_default_on_gpu(layout):
    """Four query heads a kv head (the 4B/8B shapes) on short spans: the 16-token default tile against the
    reference, the same bits as the 32-token tile, and its float8 codes as the bounded pass's."""
    from rerankit.kernels.fp8_quant import abs_max, quantize_bounded_reference

    (q, k, v), meta = make_pack(layout, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert default_config(q.device, True, 100.0, 4) == CUDA_WIDE_GROUP_CONFIG
    got = prefix_attention(q, k, v, **meta, keys_per_query=100.0)
    expected = prefix_attention_reference(q.float(), k.float(), v.float(), **meta)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(got, prefix_attention(q, k, v, **meta, config=CUDA_DEFAULT_CONFIG))
    bound = abs_max(v)
    codes, scales = prefix_attention(q, k, v, **meta, keys_per_query=100.0, fp8_bound=bound)
    expected_codes, expected_scales = quantize_bounded_reference(got.flatten(1), bound)
    assert torch.equal(scales, expected_scales)
    apart = (codes.flatten(1).float() - expected_codes.float()).abs()
    assert (apart <= expected_codes.float().abs() / 8 + 2 ** -9).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", [None, CUDA_LONG_KEYS_CONFIG, TRITON_LONG_KEYS_CONFIG],
                         ids=["default", "long-keys", "long-keys-triton"])
def test_cached_prefix_keys_on_gpu_bf16(config):
    layout = [(1076, [146] * 30), (0, [300]), (1076, [1, 200])]
    (q, k, v), meta, kept, reduced_qkv, reduced_meta, cached = cached_pack(
        layout, 1060, [0, 2], 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    whole = prefix_attention_reference(q.float(), k.float(), v.float(), **meta)[kept]
    got = prefix_attention(*reduced_qkv, **reduced_meta, config=config, cached=cached)
    torch.testing.assert_close(got.float(), whole, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_rows_on_gpu_bf16():
    """LI's layout with its head kept: each item's last token alone equals the whole pack's rows there."""
    layout = [(1076, [146] * 30), (0, [300]), (1076, [1, 200])]
    (q, k, v), meta, kept, reduced_qkv, reduced_meta, cached = cached_pack(
        layout, 1060, [0, 2], 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    whole = prefix_attention(*reduced_qkv, **reduced_meta, cached=cached, keys_per_query=LONG_KEYS_PER_QUERY)
    reads = torch.tensor([16 + 146 * (i + 1) - 1 for i in range(30)] + [len(kept) - 202, len(kept) - 1],
                         device="cuda")
    got = prefix_attention(*reduced_qkv, **reduced_meta, cached=cached, keys_per_query=LONG_KEYS_PER_QUERY,
                           reads=reads)
    torch.testing.assert_close(got.float(), whole[reads].float(), atol=1e-2, rtol=1e-2)



def test_warp_specialized_config_falls_back_off_hopper():
    """Off sm_90 (here the CPU interpreter) a warp_specialized config runs the Triton kernel with its own tiles."""
    (q, k, v), meta = make_pack(LONG_PREFIX, 4, 2, 16, seed=5)
    assert not takes_ws(q, k, v, True, None, None)
    config = dataclasses.replace(CPU_DEFAULT_CONFIG, warp_specialized=True)
    torch.testing.assert_close(prefix_attention(q, k, v, **meta, config=config),
                               prefix_attention_reference(q, k, v, **meta), atol=1e-4, rtol=1e-4)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(16, 8, 128), (32, 8, 128), (16, 8, 64)],
                         ids=["0.6b", "gqa4", "d64"])
@pytest.mark.parametrize(
    "layout",
    [[(40, [5, 1, 70, 130])], [(76, [130, 3, 64]), (10, [200, 1]), (0, [1])], [(0, [1500]), (0, [1700])],
     [(1076, [146] * 12), (0, [500])]],
    ids=["mis", "mis-ragged", "causal-long", "li"],
)
def test_warp_specialized_kernel_matches_reference(layout, q_heads, kv_heads, head_dim, dtype):
    """The Gluon kernel on the projection's views: every mask range, GQA groups of 2 and 4, both head sizes."""
    qkv, meta = make_pack(layout, q_heads, kv_heads, head_dim, dtype=dtype, device="cuda")
    q, k, v = projection_views(*qkv)
    assert takes_ws(q, k, v, True, None, None)
    expected = prefix_attention_reference(q.float(), k.float(), v.float(), **meta)
    got = prefix_attention(q, k, v, **meta, config=CUDA_LONG_KEYS_CONFIG)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    triton_tiles = prefix_attention(q, k, v, **meta, config=TRITON_LONG_KEYS_CONFIG)
    torch.testing.assert_close(got.float(), triton_tiles.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_warp_specialized_kernel_with_kept_keys_and_a_batch_prefix():
    """Kept prefix keys (a partial last tile) before a batch prefix and spans, on two sequences."""
    layout = [(20, [146] * 5), (0, [33, 90])]
    qkv, meta = make_pack(layout, 16, 8, 128, dtype=torch.bfloat16, device="cuda", seed=3)
    q, k, v = projection_views(*qkv)
    gen = torch.Generator().manual_seed(4)
    kept_k, kept_v = (torch.randn(1113, 8, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    cached = (torch.tensor([1076, 1076], dtype=torch.int32, device="cuda"), kept_k, kept_v)
    assert takes_ws(q, k, v, True, None, cached)
    expected = prefix_attention_reference(q.float(), k.float(), v.float(), **meta,
                                          cached=(cached[0], kept_k.float(), kept_v.float()))
    got = prefix_attention(q, k, v, **meta, config=CUDA_LONG_KEYS_CONFIG, cached=cached)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 (sm_89+)")
@pytest.mark.parametrize("config", [None, TRITON_LONG_KEYS_CONFIG, CUDA_LONG_KEYS_CONFIG],
                         ids=["default", "long-keys-triton", "long-keys"])
@pytest.mark.parametrize("layout", [[(76, [64 + 37 * i % 384 for i in range(20)] + [1])],
                                    [(1076, [146] * 12), (0, [500])]], ids=["mis-prefix-76", "li"])
def test_fp8_output_on_gpu_bf16(layout, config):
    """``fp8_bound`` on the projection's views, bf16: the codes written by the Triton tiles (or, after the Gluon
    kernel, by the bounded quantization pass) stand for the bf16 output within e4m3's step, one scale a row."""
    from rerankit.kernels.fp8_quant import abs_max, quantize_bounded_reference

    qkv, meta = make_pack(layout, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = projection_views(*qkv)
    bound = abs_max(v)
    plain = prefix_attention(q, k, v, **meta, config=config)
    codes, scales = prefix_attention(q, k, v, **meta, config=config, fp8_bound=bound)
    expected_codes, expected_scales = quantize_bounded_reference(plain.flatten(1), bound)
    assert torch.equal(scales, expected_scales)
    back = codes.flatten(1).float() * scales[:, None]
    step = plain.flatten(1).float().abs() * 2 ** -3 + bound / 448 * 2 ** -9  # an e4m3 step, or a subnormal's
    assert ((back - plain.flatten(1).float()).abs() <= step).all()
    # the Triton tiles quantize their float32 tile, the pass the bf16 output: codes one step apart at most
    apart = (codes.flatten(1).float() - expected_codes.float()).abs()
    assert (apart <= expected_codes.float().abs() / 8 + 2 ** -9).all()
