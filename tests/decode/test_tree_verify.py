import math

import pytest
import torch

from eaglewire.decode.spec_decoder import SpecConfig, check_spec_flags
from eaglewire.decode.sampling import SamplingParams, logits_to_probs
from eaglewire.decode.tree import Candidate, Tree, max_tree_tokens, select_tree, top_children
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


def test_select_tree_keeps_best_and_is_closed_under_ancestors():
    d2t = torch.arange(10)
    level1 = top_children(torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0, -1.0]]), -1), [0.0], [-1], 1, 2, d2t)
    assert [c.token for c in level1] == [0, 1]
    level2 = top_children(torch.log_softmax(torch.tensor([[0.0, 5.0, 1.0, 0.0]]), -1), [level1[0].score], [0], 2, 2, d2t)
    t, chosen = select_tree(7, level1 + level2, 4)
    assert t.tokens.tolist()[0] == 7 and len(t) == 4
    for i in range(1, len(t)):
        assert int(t.parents[i]) < i  # parents precede children
        assert float(t.scores[i]) <= float(t.scores[int(t.parents[i])])


def test_select_tree_drops_candidates_below_the_least_path_probability():
    d2t = torch.arange(10)
    level1 = top_children(torch.log(torch.tensor([[0.6, 0.3, 0.1]])), [0.0], [-1], 1, 2, d2t)
    level2 = top_children(torch.log(torch.tensor([[0.5, 0.4, 0.1]])), [level1[0].score], [0], 2, 2, d2t)
    cands = level1 + level2  # path probabilities 0.6, 0.3, 0.3, 0.24
    assert len(select_tree(7, cands, 5)[0]) == 5
    t, chosen = select_tree(7, cands, 5, min_score=math.log(0.25))
    assert chosen == [0, 1, 2] and t.parents.tolist() == [-1, 0, 0, 1]
    t, chosen = select_tree(7, cands, 5, min_score=math.log(0.7))
    assert chosen == [] and t.tokens.tolist() == [7]  # the root alone: a plain step


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
