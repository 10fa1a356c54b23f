"""Pack layouts for the attention kernel's tests and benchmark: (prefix length, item lengths) per sequence."""

from __future__ import annotations

import torch


def pack_meta(layout, device="cpu"):
    """Pack metadata for ``layout``: one (prefix_len, item_lens) per sequence.

    A sequence with prefix_len 0 and one item is a plain causal sequence.
    """
    cu, prefix_lens, span_starts = [0], [], []
    for prefix_len, item_lens in layout:
        seq_start = cu[-1]
        span_starts += [seq_start] * prefix_len
        item_start = seq_start + prefix_len
        for item_len in item_lens:
            span_starts += [item_start] * item_len
            item_start += item_len
        cu.append(item_start)
        prefix_lens.append(prefix_len)
    return dict(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen=max(end - start for start, end in zip(cu[:-1], cu[1:])),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        span_starts=torch.tensor(span_starts, dtype=torch.int32, device=device),
    )
