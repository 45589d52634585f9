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


def top_children(logprobs: torch.Tensor, parent_scores: list[float], parents: list[int], depth: int,
                 topk: int, draft_to_target: torch.Tensor) -> list[Candidate]:
    """The ``topk`` best children of each frontier node.

    logprobs [F, Vd] draft log-probabilities of the F frontier nodes; returns F*topk candidates.
    """
    values, ids = logprobs.topk(topk, dim=-1)  # [F, k]
    tokens = draft_to_target[ids]  # [F, k] target ids
    tokens, values = tokens.tolist(), values.tolist()  # one read each: on a GPU every element read is a sync
    return [Candidate(token=tokens[f][j], score=parent_scores[f] + values[f][j], parent=parents[f], depth=depth)
            for f in range(len(tokens)) for j in range(topk)]


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
    n = logprobs.shape[0]
    ids = torch.arange(logprobs.shape[1], device=logprobs.device)  # [V] the block predicts target ids
    candidates: list[Candidate] = []
    level = top_children(logprobs[:1], [0.0], [-1], 1, topk, ids)
    for depth in range(1, n + 1):
        base = len(candidates)
        candidates += level
        if depth == n:
            break
        ranked = sorted(range(len(level)), key=lambda i: -level[i].score)[:topk]
        frontier = [base + i for i in ranked if level[i].score >= min_score]  # [F] candidate indices
        if not frontier:  # deeper nodes score lower still: none could be verified
            break
        rows = logprobs[depth:depth + 1].expand(len(frontier), -1)  # [F, V]: one distribution per position
        level = top_children(rows, [candidates[c].score for c in frontier], frontier, depth + 1, topk, ids)
    tree, _ = select_tree(root_token, candidates, num_draft_tokens, min_score)
    return tree
