"""EAGLE-3 chains of several sequences drafted together (continuous batching's speculative rounds on the CPU).

Shapes: B sequences drafting, n of them still drafting at a level, H hidden, nH / nKV heads, hd head dim, S_b
entries in sequence b's draft cache.

A chain (topk 1) drafts one node a sequence per level, so a level of B sequences is one pass of the draft over B
rows: one GEMM per weight for all of them -- the draft head's included, which at a 32k draft vocabulary is most of
a draft step's bytes -- and attention per sequence over its own cache (its context, then its chain so far). Drafted
one sequence at a time, B sequences stream the draft's weights B times a level. Each sequence's chain is what its
own drafter would propose (the same levels, scores summed in double, the same floor), up to the rounding of a
batched GEMM, which can only change which tokens are proposed, never what the target accepts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eaglewire.decode.kv_cache import DraftCache, top_next
from eaglewire.decode.tree import Candidate, Tree, select_tree


def can_batch(drafters: list, topk: int) -> bool:
    """Whether ``draft_chains`` can draft these drafters' round together: chains, EAGLE-3 drafters sharing one packed
    draft, each on a growing cache with its last context entry's output at hand."""
    from eaglewire.decode.eagle3_drafter import Eagle3Drafter

    return (topk == 1 and len(drafters) > 1 and all(isinstance(d, Eagle3Drafter) for d in drafters)
            and all(d.draft is drafters[0].draft and isinstance(d.cache, DraftCache) and d.root_out is not None
                    for d in drafters))


@torch.no_grad()
def draft_chains(drafters: list, roots: list[int], positions: list[int], num_steps: int,
                 min_score: float) -> list[Tree]:
    """Each drafter's chain of ``num_steps`` tokens after its root at ``positions[b]`` (its context's length), drafted
    level by level for all of them at once; nodes scoring below ``min_score`` are neither drafted on nor verified."""
    first = drafters[0]
    draft, to_target = first.draft, first.draft_to_target
    hidden = torch.cat([d.root_out[0] for d in drafters])  # [B, H]
    values, ids = top_next(draft, hidden, 1)  # [B, 1] each
    scores, tokens = values[:, 0].double(), to_target[ids[:, 0]]  # [B]
    chains: list[list[Candidate]] = [[Candidate(int(t), float(s), -1, 1)] for t, s in zip(tokens, scores)]
    drafting = list(range(len(drafters)))  # the sequences still drafting; hidden, scores and tokens are theirs
    for depth in range(1, num_steps):
        kept = [i for i, b in enumerate(drafting) if chains[b][-1].score >= min_score]
        drafting = [drafting[i] for i in kept]
        if not drafting:
            break
        keep = torch.tensor(kept, dtype=torch.long, device=hidden.device)  # [n]
        hidden, scores, tokens = hidden[keep], scores[keep], tokens[keep]
        at = torch.tensor([positions[b] - 1 + depth for b in drafting], device=hidden.device)  # [n]: a node of
        # depth d runs at P - 1 + d
        hidden = draft_rows(draft, [drafters[b].cache for b in drafting], first.embed(tokens)[0], hidden, at)  # [n, H]
        values, ids = top_next(draft, hidden, 1)  # [n, 1] each
        scores, tokens = scores + values[:, 0].double(), to_target[ids[:, 0]]  # [n]
        for b, t, s in zip(drafting, tokens.tolist(), scores.tolist()):
            chains[b].append(Candidate(t, s, len(chains[b]) - 1, depth + 1))
    for d in drafters:
        d.cache.rollback()
    return [select_tree(root, chain, num_steps + 1, min_score)[0] for root, chain in zip(roots, chains)]


def draft_rows(draft, caches: list[DraftCache], emb: torch.Tensor, hidden: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """One new entry per cache, run through the draft together: emb/hidden [n, H], positions [n] -> pre-norm [n, H];
    row r's keys and values are appended to ``caches[r]`` and it attends to everything there (a chain's node sees
    its context and its ancestors, which is all its cache holds while drafting)."""
    layer = draft.midlayer
    attn = layer.self_attn
    cos, sin = draft.rotary(positions[None], emb.dtype)  # [1, n, hd]
    q, k, v = attn.qkv(layer.attn_input(emb[None], hidden[None]), cos, sin)  # [1, nH, n, hd], [1, nKV, n, hd]
    outs = []
    for r, cache in enumerate(caches):
        cache.append(k[:, :, r:r + 1], v[:, :, r:r + 1])  # [1, nKV, 1, hd]
        outs.append(F.scaled_dot_product_attention(q[:, :, r:r + 1], attn.expand_kv(cache.k),
                                                   attn.expand_kv(cache.v)))  # [1, nH, 1, hd]
    return layer.finish(hidden[None], attn.out(torch.cat(outs, dim=2)))[0]  # [n, H]
