import pytest
import torch

from eaglewire.model.vocab import build_draft_vocab, count_tokens, frequency_coverage


def test_top_tokens_sorted_with_offsets():
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 2, 0])
    d2t, t2d = build_draft_vocab(counts, 3)
    chosen = torch.arange(3) + d2t
    assert chosen.tolist() == [1, 3, 5]  # top 3 by count, ascending ids
    assert t2d.nonzero().flatten().tolist() == [1, 3, 5]
    assert frequency_coverage(counts, t2d) == pytest.approx(21 / 24)


def test_pads_with_low_unused_ids():
    counts = torch.tensor([0, 0, 4, 0, 3, 0])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 4]
    assert int(t2d.sum()) == 4


def test_counts_only_masked_tokens():
    ids = torch.tensor([1, 2, 2, 3])
    mask = torch.tensor([0, 1, 1, 0])
    assert count_tokens([(ids, mask)], 5).tolist() == [0, 0, 2, 0, 0]


def test_draft_vocab_larger_than_target_vocab():
    with pytest.raises(ValueError, match="draft_vocab_size 10 must be in \\[1, 8\\]"):
        build_draft_vocab(torch.ones(8), 10)
