"""Verification of a draft tree against the target's distributions.

Terms: *accepted* nodes are draft tokens the target agrees with, along one root-to-node
path; the *bonus token* is the target's own next token after the last accepted node
(greedy: its argmax; sampling: drawn from the residual distribution).
Shapes: N tree nodes, V target vocabulary.
"""

from __future__ import annotations

import torch

from eaglewire.decode.tree import Tree


def greedy_verify(tree: Tree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose tokens equal the target's argmax; returns (path node ids incl. root, bonus).

    target_argmax [N]: the target's greedy next token after each node.
    """
    kids = tree.children()
    path = [0]
    while True:
        want = int(target_argmax[path[-1]])
        nxt = next((c for c in kids[path[-1]] if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)


def sampling_verify(tree: Tree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings; lossless for deterministic (top-k) drafts.

    target_probs [N, V]: the target's sampling distribution after each node. At a node,
    children are tried best first: child token x is accepted with probability
    p(x) / sum(p); a rejected token's mass is removed from p. When no child is accepted,
    the bonus token is drawn from what is left of p. Every output token is therefore
    distributed exactly as the target's sampling distribution.
    """
    kids = tree.children()
    path = [0]
    p = target_probs[0].clone()
    while True:
        accepted = None
        for c in kids[path[-1]]:
            tok = int(tree.tokens[c])
            if torch.rand((), generator=generator) * p.sum() < p[tok]:
                accepted = c
                break
            p[tok] = 0.0
        if accepted is None:
            bonus = int(torch.multinomial(p / p.sum(), 1, generator=generator))
            return path, bonus
        path.append(accepted)
        p = target_probs[accepted].clone()
