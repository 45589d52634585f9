"""EAGLE-2 dynamic draft trees.

Shapes: N tree nodes (node 0 = the root: the last token the target produced), k = topk.

A tree is built level by level: the ``topk`` best children of every frontier node are
candidates; the ``topk`` candidates of a level with the highest cumulative log-probability
form the next frontier. At the end the ``num_draft_tokens - 1`` best candidates overall
(by cumulative log-probability) plus the root are verified. A child's score never exceeds
its parent's, so the selection is closed under ancestors, also when a floor on the score
(``min_score``: a least path probability) drops candidates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Tree:
    tokens: torch.Tensor  # [N] token ids; tokens[0] = root
    parents: torch.Tensor  # [N] parent index, -1 for the root
    depths: torch.Tensor  # [N] 0 for the root
    scores: torch.Tensor  # [N] cumulative log-probability (0 for the root)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] = j is i or an ancestor of i (what node i attends to)."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):  # parents precede children
            mask[i] |= mask[int(self.parents[i])]
        return mask

    def children(self) -> list[list[int]]:
        """Children of every node, best score first."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i in range(1, len(self)):
            kids[int(self.parents[i])].append(i)
        for k in kids:
            k.sort(key=lambda c: -float(self.scores[c]))
        return kids


@dataclass
class Candidate:
    token: int
    score: float  # cumulative log-probability
    parent: int  # index into the candidate list, -1 = root
    depth: int


Children = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


Level = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # one level's (tokens [C], parents [C], scores [C] double)


def grow_tree(root_top: tuple[torch.Tensor, torch.Tensor], children: Children, num_levels: int, topk: int,
              ids_to_tokens: torch.Tensor | None, min_score: float = -math.inf) -> list[Candidate]:
    """EAGLE-2's levels (``grow_levels``), read to the host once."""
    return read_candidates(pack_levels(grow_levels(root_top, children, num_levels, topk, ids_to_tokens, min_score)))


def grow_levels(root_top: tuple[torch.Tensor, torch.Tensor], children: Children, num_levels: int, topk: int,
                ids_to_tokens: torch.Tensor | None, min_score: float = -math.inf) -> list[Level]:
    """EAGLE-2's levels, grown on the device the log-probabilities live on.

    ``root_top`` (values [1, k], ids [1, k]): the root's ``topk`` best children, log-probabilities and draft
    ids. ``children(depth, order, tokens)`` -> (values [F, k], ids [F, k]): the ``topk`` best children of a
    level's F best nodes (``order`` [F]: their indices within the level, best first; ``tokens`` [F]: their
    target ids; ``depth``: theirs). ``ids_to_tokens`` [Vd] maps draft ids to target ids (None: the same).

    Without a floor every level's F = ``topk`` best nodes get children: fixed shapes, and the host out of the
    loop (on a GPU a read is a synchronisation; a CUDA graph can hold the whole of it). With one, a count is
    read per level: the nodes under it are left out (their subtrees score lower still, so ``select_tree`` would
    never take them), and none left stops the drafting. Scores are summed in double, ties go to the lower index
    (a stable sort): as the host summed and sorted them.
    """
    def tokens_of(ids: torch.Tensor) -> torch.Tensor:
        return ids if ids_to_tokens is None else ids_to_tokens[ids]

    values, ids = root_top
    scores = values[0].double()  # [k] cumulative log-probability of each candidate of the level
    tokens = tokens_of(ids[0])  # [k]
    parents = torch.full_like(tokens, -1)  # [k] candidate index of each one's parent (-1: the root)
    levels = [(tokens, parents, scores)]
    base = 0  # candidate index of the level's first node
    for depth in range(1, num_levels):
        order = torch.sort(scores, descending=True, stable=True).indices[:topk]  # [F] the level's best
        best = scores[order]  # [F], best first
        if min_score > -math.inf:
            reach = int((best >= min_score).sum())  # a host read, only where a floor is set
            if not reach:  # deeper nodes score lower still: none could be verified
                break
            order, best = order[:reach], best[:reach]
        values, ids = children(depth, order, tokens[order])  # [F, k] each
        parents = (base + order).repeat_interleave(topk)  # [F*k]
        base += scores.numel()
        scores = (best[:, None] + values.double()).reshape(-1)  # [F, k] -> [F*k]
        tokens = tokens_of(ids).reshape(-1)  # [F, k] -> [F*k]
        levels.append((tokens, parents, scores))
    return levels


def pack_levels(levels: list[Level]) -> torch.Tensor:
    """The levels as one tensor [4, C] double, rows (token, parent, depth, score) of every candidate in level
    order: one read for the whole tree (ids and depths are exact in double)."""
    depths = [torch.full_like(scores, d + 1) for d, (_, _, scores) in enumerate(levels)]
    return torch.stack([torch.cat([t for t, _, _ in levels]).double(), torch.cat([p for _, p, _ in levels]).double(),
                        torch.cat(depths), torch.cat([s for _, _, s in levels])])  # [4, C]


def read_candidates(packed: torch.Tensor) -> list[Candidate]:
    """``pack_levels``' tensor [4, C], read to the host, as Candidates."""
    tokens, parents, depths, scores = packed.tolist()
    return [Candidate(token=int(t), score=s, parent=int(p), depth=int(d))
            for t, p, d, s in zip(tokens, parents, depths, scores)]


def select_tree(root_token: int, candidates: list[Candidate], num_draft_tokens: int,
                min_score: float = -math.inf) -> tuple[Tree, list[int]]:
    """Root + the best ``num_draft_tokens - 1`` candidates scoring at least ``min_score``; returns
    the tree and, per tree node except the root, the candidate index it came from."""
    # Higher score first; ties by depth so a parent always precedes its child.
    order = sorted((i for i in range(len(candidates)) if candidates[i].score >= min_score),
                   key=lambda i: (-candidates[i].score, candidates[i].depth, i))
    chosen = sorted(order[:num_draft_tokens - 1], key=lambda i: (candidates[i].depth, i))
    node_of = {c: n + 1 for n, c in enumerate(chosen)}
    tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
    for c in chosen:
        cand = candidates[c]
        tokens.append(cand.token)
        parents.append(0 if cand.parent < 0 else node_of[cand.parent])
        depths.append(cand.depth)
        scores.append(cand.score)
    tree = Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                scores=torch.tensor(scores))
    return tree, chosen


def max_tree_tokens(num_steps: int, topk: int) -> int:
    """The most nodes a tree of ``num_steps`` levels can offer, root included."""
    return 1 + topk + (num_steps - 1) * topk * topk


def block_tree(root_token: int, logprobs: torch.Tensor, topk: int, num_draft_tokens: int,
               min_score: float = -math.inf) -> Tree:
    """A tree from one block draft's per-position log-probabilities, logprobs [n, V] (row d-1: the
    token at depth d), grown and selected as EAGLE-2's: each level's ``topk`` best nodes get the
    ``topk`` best tokens of the next position. A block does not see which token its earlier
    positions took, so siblings' children are the same tokens; with topk 1 it is the chain of
    each position's best token (cut where the path probability falls below ``min_score``)."""
    values, ids = logprobs.topk(topk, dim=-1)  # [n, k]: the block predicts target ids

    def children(depth: int, order: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        F = order.numel()
        return values[depth:depth + 1].expand(F, -1), ids[depth:depth + 1].expand(F, -1)  # [F, k] each

    candidates = grow_tree((values[:1], ids[:1]), children, logprobs.shape[0], topk, None, min_score)
    tree, _ = select_tree(root_token, candidates, num_draft_tokens, min_score)
    return tree
