"""The attention kernel's tile configs (``AttentionConfig``): the defaults per device and kind of attention, and
``$RERANKIT_ATTENTION_CONFIG``, which replaces fields of the default (see ``kernels/prefix_attention.py``)."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch shape of the kernel.

    ``block_m`` is the number of query tokens of a program; with ``pack_gqa`` its Q tile holds them for
    all the query heads of one kv head (``block_m * next_pow2(GROUP)`` rows). ``block_n`` is the key tile.
    """

    block_m: int = 128
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    pack_gqa: bool = False
    tma: bool = False  # K/V tiles through tensor descriptors (Hopper's copy engine), where the layout allows
    maxnreg: int | None = None  # a cap on registers per thread (CUDA only), so that more programs share an SM
    # Causal calls that compute every row (no ``reads``) go to the warp-specialized Hopper kernel
    # (:mod:`rerankit.kernels.prefix_attention_ws`) where it runs (``takes_ws``); the other fields then do not apply.
    warp_specialized: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"AttentionConfig.{name} must be a power of two, not {value}")
        if self.num_stages < 1:
            raise ValueError(f"AttentionConfig.num_stages must be >= 1, not {self.num_stages}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"AttentionConfig.maxnreg must be None or 24..255, not {self.maxnreg}")


# benchmarks/attention.py --sweep on an H100 (ms per layer, Hq16/Hkv8/D128 bf16), 2026-11-23, K/V through tensor
# descriptors: the GQA-packed 32-token tile (64 MMA rows) with 4 warps and 2 stages ran W1 MIS 0.229 / W1 plain 0.247 /
# 1k-prefix MIS 0.335 / 32k documents 1.124 against 0.273 / 0.293 / 0.357 / 1.116 for the 64-token tile with 8 warps
# and 3 stages that was the default before (16% less on W1's short item spans, whose diagonal tiles it wastes less
# of). Where queries see many keys (the 1k-prefix packs, long documents) 64-token tiles of 64 keys with 8 warps, 2
# stages and 128 registers a thread did best: 1k-prefix MIS 0.304, 1k-prefix plain 1.638 (against 1.668), 32k
# documents 1.035. ``default_config`` takes that one from LONG_KEYS_PER_QUERY keys a query on (W1's MIS packs see
# ~230, the 1k-prefix ones ~600-1,200). The D=64 encoder keeps the 4-warp pointer tile (descriptors and 8 warps ran it
# at 0.394 ms against 0.200).
# 2026-11-25, evening: on Hopper the long-keys default hands its calls to the warp-specialized Gluon kernel (LI's
# pack with its head kept 0.309 ms against 0.369 for the tile below, 1k-prefix MIS 1.15x, 32k documents 1.03x; the
# tile below stays for other GPUs, the read rows, and as the reference).
CUDA_DEFAULT_CONFIG = AttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=2, pack_gqa=True, tma=True)
# Four or more query heads a kv head (Qwen3-4B/8B: 32 / 8): the 32-token tile stacks 128 MMA rows; 16 tokens keep the
# 64 rows above and waste less of each item's diagonal tiles. H100 80GB HBM3, 2026-11-27, `benchmarks/attention.py
# --sweep-only --sweep-set gqa4 --workloads 4b` (ms a layer, the same bits): W1's first 32 documents 0.157 against
# 0.176 for the 32-token tile, its 84 after the ramp's 16 0.384 against 0.439 (16 tokens with 2 stages 0.165 / 0.404;
# 8 warps or 64-key tiles 0.182-0.259 / 0.471-0.671).
CUDA_WIDE_GROUP_CONFIG = AttentionConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, pack_gqa=True, tma=True)
WIDE_GROUP = 4
CUDA_LONG_KEYS_CONFIG = AttentionConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, pack_gqa=True, tma=True,
                                        maxnreg=128, warp_specialized=True)
LONG_KEYS_PER_QUERY = 512
CUDA_BIDIRECTIONAL_CONFIG = AttentionConfig(block_m=64, block_n=32, num_warps=4, num_stages=3, pack_gqa=True)
# The interpreter runs numpy per program; small tiles keep test packs multi-tile.
CPU_DEFAULT_CONFIG = AttentionConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)
CONFIG_ENV = "RERANKIT_ATTENTION_CONFIG"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_config(spec: str, base: AttentionConfig = CUDA_DEFAULT_CONFIG) -> AttentionConfig:
    """``base`` with the fields of ``spec`` ("pack_gqa=1,block_m=64,block_n=64,num_warps=4,num_stages=3") replaced."""
    fields = {field.name: field.type for field in dataclasses.fields(AttentionConfig)}
    changes: dict[str, int | bool | None] = {}
    for item in spec.replace(";", ",").split(","):
        if not item.strip():
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or name not in fields:
            raise ValueError(f"bad attention config item {item.strip()!r} in {spec!r}: expected field=value with "
                             f"field one of {', '.join(fields)}")
        if fields[name] in (bool, "bool"):
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(f"bad {name} value {value!r} in {spec!r}: expected 1/0/true/false")
            changes[name] = value.lower() in _TRUE
        elif name == "maxnreg" and value.lower() in ("none", "0"):
            changes[name] = None
        else:
            try:
                changes[name] = int(value)
            except ValueError:
                raise ValueError(f"bad {name} value {value!r} in {spec!r}: expected an integer") from None
    return dataclasses.replace(base, **changes)


@functools.lru_cache(maxsize=16)
def _config_from_env(spec: str, base: AttentionConfig) -> AttentionConfig:
    try:
        return parse_config(spec, base)
    except ValueError as err:
        raise ValueError(f"{CONFIG_ENV}: {err}") from None


def default_config(device: torch.device, causal: bool = True, keys_per_query: float = 0.0,
                   group: int = 1) -> AttentionConfig:
    """Kernel tiles for ``device``: on CUDA three shapes for causal attention, by the mean number of keys a query sees
    (``keys_per_query``, 0 when not known) and the query heads a kv head has (``group``), and one for bidirectional
    attention (encoders); small tiles for the CPU interpreter.

    :data:`CUDA_DEFAULT_CONFIG` (:data:`CUDA_WIDE_GROUP_CONFIG` for groups of :data:`WIDE_GROUP` heads or more, and
    :data:`CUDA_LONG_KEYS_CONFIG` from :data:`LONG_KEYS_PER_QUERY` keys a query on) / :data:`CUDA_BIDIRECTIONAL_CONFIG`
    / :data:`CPU_DEFAULT_CONFIG`, with the fields of the environment variable ``RERANKIT_ATTENTION_CONFIG`` (when
    set) replaced; see the module docstring.
    """
    if device.type != "cuda":
        base = CPU_DEFAULT_CONFIG
    elif not causal:
        base = CUDA_BIDIRECTIONAL_CONFIG
    elif takes_long_keys_tile(causal, keys_per_query):
        base = CUDA_LONG_KEYS_CONFIG
    else:
        base = CUDA_WIDE_GROUP_CONFIG if group >= WIDE_GROUP else CUDA_DEFAULT_CONFIG
    spec = os.environ.get(CONFIG_ENV, "").strip()
    return _config_from_env(spec, base) if spec else base


def takes_long_keys_tile(causal: bool, keys_per_query: float) -> bool:
    """Whether :func:`default_config` gives attention of this kind :data:`CUDA_LONG_KEYS_CONFIG` on CUDA: causal, and
    queries that see :data:`LONG_KEYS_PER_QUERY` keys or more on average."""
    return causal and keys_per_query >= LONG_KEYS_PER_QUERY
