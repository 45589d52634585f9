"""An EAGLE-3 drafting round as one function of device tensors with fixed shapes: what one CUDA graph replays.

A round drafted a level at a time launches its work from the host: a level's graph, then the masks, the
embedding, the sort and the bookkeeping of the next level as separate small kernels (about 200 host-side ops a
chain-of-3 round), each a launch the GPU waits for -- on the H200 a drafted level cost 1.56 ms in the loop
against 0.59 ms for its graph alone. Without a floor on the path probability (``--draft-min-prob 0``) every
shape in a round is known from (num_steps, topk) and the number T of context entries it adds, so the whole of
it -- the last round's accepted tokens entered into the draft's context, the root's top-k, every level, the
candidates packed for one read -- is one replay and one read.

Shapes: T new context entries, W the static cache's width, F a level's nodes, H hidden, k = topk, C candidates.
The same math as the level-at-a-time round over ``StaticDraftCache`` (the same masks, positions, slots and
kernels), so the same trees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eaglewire.decode.kv_cache import static_draft_forward, top_next
from eaglewire.decode.tree import grow_levels, pack_levels

Embed = Callable[[torch.Tensor], torch.Tensor]  # target ids [n] -> the draft's input embeddings [1, n, H]


def extend_context(draft, embed: Embed, k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor,
                   aux: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """T context entries at columns and positions start..start+T-1: aux [T, k*H] the target's states, ids [T]
    the token after each, start [] -> pre-norm [1, T, H]. Each entry attends to every column before it and
    itself (the committed context, then causal)."""
    T, dev = ids.shape[0], ids.device
    positions = start + torch.arange(T, device=dev)  # [T]
    columns = torch.arange(k_cache.shape[2], device=dev)  # [W]
    mask = (columns[None, :] <= positions[:, None])[None, None]  # [1, 1, T, W]
    emb = embed(ids)  # [1, T, H]
    hidden = draft.fuse(aux[None].to(emb.dtype))  # [1, T, H]
    return static_draft_forward(draft, k_cache, v_cache, emb, hidden, positions[None], positions, mask)[0]


class StaticLevels:
    """``grow_levels``' children over the static cache, with nothing read by the host: a level's F nodes run as one
    block at the scratch columns after the previous levels' (committed + the nodes drafted so far), each
    attending to the committed context, its ancestors' columns and itself, at position committed - 1 + depth."""

    def __init__(self, draft, embed: Embed, k_cache: torch.Tensor, v_cache: torch.Tensor, root_out: torch.Tensor,
                 committed: torch.Tensor, topk: int) -> None:
        self.draft, self.embed, self.k, self.v, self.committed, self.topk = draft, embed, k_cache, v_cache, committed, topk
        self.columns = torch.arange(k_cache.shape[2], device=root_out.device)  # [W]
        self.hidden = root_out[0].expand(topk, -1)  # [k, H] the state each root child's logits came from
        self.rows = (self.columns < committed)[None].expand(topk, -1)  # [k, W] what each candidate's parent sees
        self.drafted = 0  # scratch columns used so far this round (fixed by the shapes)

    def __call__(self, depth: int, order: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        F = order.numel()
        slots = self.committed + self.drafted + torch.arange(F, device=order.device)  # [F]
        self.drafted += F
        rows = self.rows[order] | (self.columns[None, :] == slots[:, None])  # [F, W]: its ancestors and itself
        positions = (self.committed - 1 + depth).expand(1, F)  # [1, F]
        out = static_draft_forward(self.draft, self.k, self.v, self.embed(tokens), self.hidden[order][None],
                                   positions, slots, rows[None, None])[0]  # [1, F, H]
        values, ids = top_next(self.draft, out[0], self.topk)  # [F, k] each
        self.hidden = out[0].repeat_interleave(self.topk, dim=0)  # [F*k, H]: the next level's candidates
        self.rows = rows.repeat_interleave(self.topk, dim=0)  # [F*k, W]
        return values, ids


def draft_round(draft, embed: Embed, k_cache: torch.Tensor, v_cache: torch.Tensor, ids_to_tokens: torch.Tensor | None,
                num_steps: int, topk: int, *, start: torch.Tensor, ids: torch.Tensor | None = None,
                aux: torch.Tensor | None = None, root_out: torch.Tensor | None = None) -> tuple[torch.Tensor]:
    """A round over the static cache, committed context 0..start-1: first the T entries ``ids`` / ``aux`` (the last
    round's accepted tokens) at start.., their last output the root's state; or (no ``ids``) the root's state
    ``root_out`` [1, 1, H] given. Then the root's top-k and ``num_steps - 1`` levels of ``topk`` nodes in the
    scratch columns after the context -> (the candidates, ``pack_levels`` [4, C],)."""
    committed = start
    if ids is not None:
        root_out = extend_context(draft, embed, k_cache, v_cache, ids, aux, start)[:, -1:]  # [1, 1, H]
        committed = start + ids.shape[0]
    levels = StaticLevels(draft, embed, k_cache, v_cache, root_out, committed, topk)
    root_top = top_next(draft, root_out[0], topk)  # ([1, k], [1, k])
    return (pack_levels(grow_levels(root_top, levels, num_steps, topk, ids_to_tokens)),)
