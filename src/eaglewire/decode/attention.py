"""Attention for decoding: grouped-query attention that keeps SDPA on its fused kernel, and a verify's rows one at a
time as plain steps compute them (bf16 on CPU).

Shapes: nH / nKV query / key-value heads, G = nH / nKV, n query rows, m keys, P committed tokens, N block rows,
S cache columns, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q [..., nH, n, hd]; k/v [..., nKV, m, hd]; mask [..., 1, n, m] bool or None (all keys)
    -> [..., nH, n, hd].

    Grouped-query attention without repeating K/V: the G query heads of a key-value head are
    stacked as G*n query rows of that head (rows ordered (g, t)), the mask tiled to match. This
    keeps SDPA on its fused CPU kernel; ``enable_gqa`` sends it to the slow math path, and so
    do unbatched (3-d) inputs, which therefore get a batch dimension of one.
    """
    if q.dim() == 3:
        return attend(q[None], k[None], v[None], None if mask is None else mask[None], scale)[0]
    *lead, nH, n, hd = q.shape
    G = nH // k.shape[-3]
    if G > 1:
        q = q.reshape(*lead, nH // G, G * n, hd)  # [..., nKV, G*n, hd]
        mask = None if mask is None else torch.cat([mask] * G, dim=-2)  # [..., 1, G*n, m]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [..., nKV, G*n, hd]
    return out.reshape(*lead, nH, n, hd)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, rows: list[torch.Tensor | None],
                scale: float) -> torch.Tensor:
    """Attention of a block's rows one query at a time, each exactly as plain decoding computes it: q [nH, N, hd];
    k/v [nKV, S, hd] (the cache, block rows at ``prefix``..); ``rows[r]`` the block rows that row r sees besides
    the prefix, in order (None: rows 0..r, a chain) -> [nH, N, hd].

    Why: in bf16 the fused attention kernel's result for a row depends on how many rows it is computed with (one
    bf16 ulp apart, measured), and a bf16 ulp in a state flips later greedy tokens: a verify of N tokens would not
    be N plain steps. One query with its keys, unmasked, is the plain step's own call, so greedy speculative
    output equals plain decoding's in bf16 too (the projections are row-exact: gemm.PackedLinear.exact_rows;
    tests/decode/test_bf16_lossless.py)."""
    out = []
    for r, seen in enumerate(rows):
        if seen is None:
            keys, values = k[:, :prefix + r + 1], v[:, :prefix + r + 1]  # [nKV, P+r+1, hd]
        else:
            keys = torch.cat([k[:, :prefix], k[:, prefix + seen]], dim=1)  # [nKV, P+len(seen), hd]
            values = torch.cat([v[:, :prefix], v[:, prefix + seen]], dim=1)
        out.append(attend(q[:, r:r + 1], keys, values, None, scale))  # [nH, 1, hd]
    return torch.cat(out, dim=1)  # [nH, N, hd]


def block_rows(mask: torch.Tensor | None, prefix: int, n: int) -> list[torch.Tensor | None]:
    """What each of a block's ``n`` rows sees of the block, from its mask [n, prefix+n] (None: causal): None for a
    row that sees rows 0..r (a chain's), else the indices it sees, ascending (a tree node's ancestors and itself)."""
    if mask is None:
        return [None] * n
    block = mask[:, prefix:].cpu()  # [n, n]
    rows: list[torch.Tensor | None] = []
    for r in range(n):
        seen = block[r].nonzero().flatten()
        rows.append(None if torch.equal(seen, torch.arange(r + 1)) else seen.to(mask.device))
    return rows
