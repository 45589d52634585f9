import math

import pytest
import torch

from eaglewire.decode.spec_config import SpecConfig, check_spec_flags
from eaglewire.decode.sampling import SamplingParams, logits_to_probs
from eaglewire.decode.tree import Candidate, Tree, grow_tree, max_tree_tokens, select_tree
from eaglewire.decode.verify import greedy_verify, sampling_verify


def tree(tokens, parents, scores=None):
    n = len(tokens)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                scores=torch.tensor(scores or [-float(i) for i in range(n)]))


def test_ancestor_mask():
    t = tree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 3])
    m = t.ancestor_mask()
    assert m[4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert m[2].nonzero().flatten().tolist() == [0, 2]


def test_greedy_verify_takes_the_longest_matching_path():
    #        root(9)
    #       /       \
    #     1(n1)     2(n2)
    #     |
    #     3(n3)
    t = tree([9, 1, 2, 3], [-1, 0, 0, 1])
    argmax = torch.tensor([2, 3, 5, 7])  # target after root says 2 -> n2, after n2 says 5 (no child)
    assert greedy_verify(t, argmax) == ([0, 2], 5)
    argmax = torch.tensor([1, 3, 5, 7])  # root -> n1 -> n3, bonus = argmax after n3
    assert greedy_verify(t, argmax) == ([0, 1, 3], 7)
    argmax = torch.tensor([4, 3, 5, 7])  # nothing accepted
    assert greedy_verify(t, argmax) == ([0], 4)


def two_levels(first: list[float], second: list[float], topk: int) -> list[Candidate]:
    """The candidates of a root whose children have log-probabilities ``first`` and each of whose best children's
    children have ``second`` (the same for every parent)."""
    first_top = torch.tensor([first]).topk(topk, dim=-1)
    second_top = torch.tensor([second]).topk(topk, dim=-1)
    return grow_tree(first_top, lambda depth, order, tokens: (second_top.values.expand(order.numel(), -1),
                                                               second_top.indices.expand(order.numel(), -1)),
                     2, topk, torch.arange(10))


def test_select_tree_keeps_best_and_is_closed_under_ancestors():
    first = torch.log_softmax(torch.tensor([3.0, 2.0, 0.0, -1.0]), -1).tolist()
    second = torch.log_softmax(torch.tensor([0.0, 5.0, 1.0, 0.0]), -1).tolist()
    cands = two_levels(first, second, 2)
    assert [c.token for c in cands[:2]] == [0, 1] and [c.parent for c in cands] == [-1, -1, 0, 0, 1, 1]
    t, chosen = select_tree(7, cands, 4)
    assert t.tokens.tolist()[0] == 7 and len(t) == 4
    for i in range(1, len(t)):
        assert int(t.parents[i]) < i  # parents precede children
        assert float(t.scores[i]) <= float(t.scores[int(t.parents[i])])


def test_select_tree_drops_candidates_below_the_least_path_probability():
    cands = two_levels(torch.log(torch.tensor([0.6, 0.3, 0.1])).tolist(),
                       torch.log(torch.tensor([0.5, 0.4, 0.1])).tolist(), 2)
    # path probabilities 0.6, 0.3; under 0.6: 0.3, 0.24; under 0.3: 0.15, 0.12
    assert len(select_tree(7, cands, 5)[0]) == 5
    t, chosen = select_tree(7, cands, 5, min_score=math.log(0.25))
    assert chosen == [0, 1, 2] and t.parents.tolist() == [-1, 0, 0, 1]
    t, chosen = select_tree(7, cands, 5, min_score=math.log(0.7))
    assert chosen == [] and t.tokens.tolist() == [7]  # the root alone: a plain step


def frontier_tree(table: torch.Tensor, root: int, num_steps: int, topk: int, num_draft_tokens: int,
                  min_score: float) -> Tree:
    """The tree as the host grew it before ``grow_tree`` (a frontier cut at ``min_score``, scores summed in
    Python floats, ties to the lower index), for a draft whose next-token log-probabilities after token t
    are ``table[t]`` [V]: the oracle."""
    def top(parent_scores, parents, rows, depth):
        values, ids = table[rows].topk(topk, dim=-1)
        return [Candidate(token=int(ids[f, j]), score=parent_scores[f] + float(values[f, j]), parent=parents[f],
                          depth=depth) for f in range(len(parents)) for j in range(topk)]

    candidates: list[Candidate] = []
    level = top([0.0], [-1], [root], 1)
    for depth in range(1, num_steps + 1):
        base = len(candidates)
        candidates += level
        if depth == num_steps:
            break
        ranked = sorted(range(len(level)), key=lambda i: -level[i].score)[:topk]
        frontier = [base + i for i in ranked if level[i].score >= min_score]
        if not frontier:
            break
        level = top([candidates[c].score for c in frontier], frontier, [candidates[c].token for c in frontier],
                    depth + 1)
    return select_tree(root, candidates, num_draft_tokens, min_score)[0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_prob", [0.0, 0.02, 0.2])
@pytest.mark.parametrize("num_draft_tokens", [9, 31])  # 31: every candidate, so every parent shows
def test_grow_tree_gives_the_frontier_cut_tree(seed, min_prob, num_draft_tokens):
    """The levels grown on the device give the tree the host grew: same tokens, parents, order and scores (summed
    in double, ties to the lower index), with and without a floor."""
    V, num_steps, topk = 12, 4, 3
    table = torch.log_softmax(2 * torch.randn(V, V, generator=torch.Generator().manual_seed(seed)), -1)
    table[:, 5] = table[:, 6]  # a tie in every row
    min_score = math.log(min_prob) if min_prob else -math.inf
    want = frontier_tree(table, 3, num_steps, topk, num_draft_tokens, min_score)
    cands = grow_tree(table[[3]].topk(topk, dim=-1), lambda depth, order, tokens: table[tokens].topk(topk, dim=-1),
                      num_steps, topk, None, min_score)
    got = select_tree(3, cands, num_draft_tokens, min_score)[0]
    assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
    assert got.scores.tolist() == want.scores.tolist()


def test_flags_are_checked_not_adjusted():
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens must be 6 .*got 8"):
        SpecConfig(num_steps=5, topk=1, num_draft_tokens=8)
    with pytest.raises(ValueError, match="at most 13"):
        check_spec_flags(2, 3, 14)
    check_spec_flags(2, 3, 13)
    assert max_tree_tokens(5, 4) == 1 + 4 + 4 * 16
    SpecConfig(num_steps=5, topk=4, num_draft_tokens=8)  # SGLang's defaults are consistent
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="--draft-min-prob must be in \\[0, 1\\)"):
            SpecConfig(min_prob=bad)


def test_sampling_verify_is_lossless_on_a_fixed_tree():
    """Empirical distribution of the first output token equals the target's."""
    g = torch.Generator().manual_seed(0)
    p_root = torch.tensor([0.1, 0.5, 0.3, 0.1])
    probs = torch.stack([p_root, torch.full((4,), 0.25), torch.full((4,), 0.25)])
    t = tree([0, 1, 2], [-1, 0, 0])  # two children proposing tokens 1 and 2
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        path, bonus = sampling_verify(t, probs, g)
        first = int(t.tokens[path[1]]) if len(path) > 1 else bonus
        counts[first] += 1
    chi2 = (((counts - n * p_root) ** 2) / (n * p_root)).sum()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_top_p_and_top_k():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
