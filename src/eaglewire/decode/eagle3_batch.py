"""EAGLE-3 drafts of several sequences run together (continuous batching's speculative rounds on the CPU): their
chains drafted level by level (``draft_chains``), and the accepted tokens' states entered into their contexts
(``extend_together``).

Shapes: B sequences, n of them still drafting at a level, N rows of one pass (n_b of sequence b), H hidden,
k aux boundaries, nH / nKV heads, hd head dim, S_b entries in sequence b's draft cache.

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


def can_batch(drafters: list) -> bool:
    """Whether these drafters can run together (``draft_chains`` for a round of chains, ``extend_together``): several
    EAGLE-3 drafters sharing one packed draft, each on a growing cache with its last context entry's output at hand."""
    from eaglewire.decode.eagle3_drafter import Eagle3Drafter

    return (len(drafters) > 1 and all(isinstance(d, Eagle3Drafter) for d in drafters)
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
        hidden = draft_rows(draft, [drafters[b].cache for b in drafting], [1] * len(drafting), first.embed(tokens)[0],
                            hidden, at)  # [n, H]
        values, ids = top_next(draft, hidden, 1)  # [n, 1] each
        scores, tokens = scores + values[:, 0].double(), to_target[ids[:, 0]]  # [n]
        for b, t, s in zip(drafting, tokens.tolist(), scores.tolist()):
            chains[b].append(Candidate(t, s, len(chains[b]) - 1, depth + 1))
    for d in drafters:
        d.cache.rollback()
    return [select_tree(root, chain, num_steps + 1, min_score)[0] for root, chain in zip(roots, chains)]


@torch.no_grad()
def extend_together(drafters: list, entries: list[tuple[torch.Tensor, list[int], int]]) -> None:
    """Each drafter's ``extend(*entry)`` -- the accepted tokens' states aux [n_b, k*H], the token after each, the
    first one's position -- in one pass of the draft (``can_batch``'s drafters)."""
    first = drafters[0]
    draft, sizes = first.draft, [len(tokens) for _, tokens, _ in entries]
    hidden = draft.fuse(torch.cat([aux for aux, _, _ in entries]).to(first.dtype))  # [N, H]
    ids = torch.tensor([t for _, tokens, _ in entries for t in tokens], device=hidden.device)  # [N]
    positions = torch.cat([torch.arange(start, start + n) for (_, _, start), n in zip(entries, sizes)])  # [N]
    out = draft_rows(draft, [d.cache for d in drafters], sizes, first.embed(ids)[0], hidden,
                     positions.to(hidden.device))  # [N, H]
    for d, last in zip(drafters, torch.cumsum(torch.tensor(sizes), 0).tolist()):
        d.cache.commit()
        d.root_out = out[None, last - 1:last]  # [1, 1, H]


def draft_rows(draft, caches: list[DraftCache], sizes: list[int], emb: torch.Tensor, hidden: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """``sizes[b]`` new entries of each cache, run through the draft together: emb/hidden [N, H], positions [N]
    -> pre-norm [N, H]. Cache b's rows are appended to it and attend to everything before them and causally among
    themselves, as ``DraftCache.forward`` without a mask (a chain's node sees its context and its ancestors, which is
    all its cache holds while drafting)."""
    layer = draft.midlayer
    attn = layer.self_attn
    cos, sin = draft.rotary(positions[None], emb.dtype)  # [1, N, hd]
    q, k, v = attn.qkv(layer.attn_input(emb[None], hidden[None]), cos, sin)  # [1, nH, N, hd], [1, nKV, N, hd]
    outs, o = [], 0
    for cache, n in zip(caches, sizes):
        S = cache.length
        cache.append(k[:, :, o:o + n], v[:, :, o:o + n])  # [1, nKV, n, hd]
        mask = None if n == 1 else torch.ones(n, S + n, dtype=torch.bool, device=q.device).tril(S)  # [n, S+n]
        outs.append(F.scaled_dot_product_attention(q[:, :, o:o + n], attn.expand_kv(cache.k), attn.expand_kv(cache.v),
                                                   attn_mask=mask))  # [1, nH, n, hd]
        o += n
    return layer.finish(hidden[None], attn.out(torch.cat(outs, dim=2)))[0]  # [N, H]
