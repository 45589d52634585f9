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
    -> [..., nH, n, hd]. A forward of many layers prepares the mask once (``attention_bias``) and calls
    ``attend_biased`` a layer."""
    groups = q.shape[-3] // k.shape[-3]
    return attend_biased(q, k, v, attention_bias(mask, groups, q.dtype), scale)


def attention_bias(mask: torch.Tensor | None, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
    """mask [..., 1, n, m] bool (True: attend) -> the additive bias [..., 1, G*n, m] (0 or -inf in ``dtype``) for
    ``attend_biased``, its rows tiled for the G = ``groups`` query heads of a key-value head (ordered (g, t)).

    SDPA turns a bool mask into exactly this bias (0 where True, -inf elsewhere) before its kernel runs, so the
    attention is the same to the bit (tests/decode/test_runner.py); made once per forward instead of once a
    layer, a step of L layers launches ~4L fewer small kernels on CUDA (the tiling, SDPA's two scalar fills and
    its where). Every row must see some key: a row of -inf gives NaN, as a row of False does."""
    if mask is None:
        return None
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias if groups == 1 else torch.cat([bias] * groups, dim=-2)  # [..., 1, G*n, m]


def attend_biased(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """q [..., nH, n, hd]; k/v [..., nKV, m, hd]; bias [..., 1, G*n, m] from ``attention_bias`` or None (all keys)
    -> [..., nH, n, hd].

    Grouped-query attention without repeating K/V: the G query heads of a key-value head are
    stacked as G*n query rows of that head (rows ordered (g, t)), the bias tiled to match. This
    keeps SDPA on its fused CPU kernel; ``enable_gqa`` sends it to the slow math path, and so
    do unbatched (3-d) inputs, which therefore get a batch dimension of one.
    """
    if q.dim() == 3:
        return attend_biased(q[None], k[None], v[None], None if bias is None else bias[None], scale)[0]
    *lead, nH, n, hd = q.shape
    G = nH // k.shape[-3]
    if G > 1:
        q = q.reshape(*lead, nH // G, G * n, hd)  # [..., nKV, G*n, hd]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)  # [..., nKV, G*n, hd]
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
