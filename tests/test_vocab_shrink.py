import dataclasses

import pytest
import torch

from eaglewire.model.checkpoint import load_draft, read_draft_config, save_draft
from eaglewire.core.contract import HiddenStateContract, TargetFingerprint
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.model.vocab import build_draft_vocab
from eaglewire.model.vocab_shrink import (
    frequent_draft_ids,
    shrink_draft_vocab,
    shrink_to_frequent,
)

V, VD = 64, 24


def make_draft(seed=0):
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=32, target_hidden_size=48, num_aux=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=V, draft_vocab_size=VD)
    draft = Eagle3Draft(cfg).eval()
    for p in draft.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    draft.set_vocab(*build_draft_vocab(torch.randint(1, 100, (V,)), VD))
    return draft


def step_logits(draft, seed=1):
    """Logits [1, T, Vd] of one cached decoding step from random aux states."""
    g = torch.Generator().manual_seed(seed)
    aux, emb = torch.randn(1, 5, 3 * 48, generator=g), torch.randn(1, 5, 32, generator=g)
    prenorm, _, _ = draft.forward_cached(emb, draft.fuse(aux), torch.arange(5)[None], None, None, None)
    return draft.logits(prenorm)


def test_shrunk_logits_are_the_kept_rows():
    draft = make_draft()
    keep = torch.tensor([0, 3, 4, 10, 23])
    small = shrink_draft_vocab(draft, keep)
    assert small.config.draft_vocab_size == 5 and small.lm_head.weight.shape == (5, 32)
    with torch.no_grad():
        torch.testing.assert_close(step_logits(small), step_logits(draft)[..., keep])


def test_shrunk_maps_point_at_the_same_target_ids():
    draft = make_draft()
    keep = torch.tensor([1, 2, 7, 20])
    small = shrink_draft_vocab(draft, keep)
    kept_targets = draft.draft_to_target[keep]
    assert small.draft_to_target.tolist() == kept_targets.tolist()
    assert bool((small.draft_to_target[1:] > small.draft_to_target[:-1]).all())  # still ascending
    assert small.t2d.nonzero().flatten().tolist() == kept_targets.tolist()
    assert draft.config.draft_vocab_size == VD and draft.lm_head.weight.shape[0] == VD  # original untouched


def test_frequent_draft_ids_keep_the_most_counted_draft_tokens():
    draft = make_draft()
    targets = draft.draft_to_target
    counts = torch.zeros(V, dtype=torch.long)
    counts[targets[5]], counts[targets[2]], counts[targets[17]] = 50, 40, 30
    outside = int((~draft.t2d).nonzero()[0])
    counts[outside] = 1000  # not in the draft vocab: never chosen
    assert frequent_draft_ids(targets, counts, 2).tolist() == [2, 5]
    assert frequent_draft_ids(targets, counts, 3).tolist() == [2, 5, 17]
    assert frequent_draft_ids(targets, counts, 4).tolist() == [0, 2, 5, 17]  # tie at 0: the lowest id
    small = shrink_to_frequent(draft, counts, 3)
    assert small.draft_to_target.tolist() == targets[[2, 5, 17]].tolist()


@pytest.mark.parametrize("keep, message", [
    ([], "keep is empty"),
    ([0, 24], "keep holds draft ids 0..24; they must be in \\[0, 23\\]"),
    ([-1, 3], "keep holds draft ids -1..3"),
    ([3, 1], "strictly ascending"),
    ([1, 1, 2], "strictly ascending"),
])
def test_bad_keep(keep, message):
    with pytest.raises(ValueError, match=message):
        shrink_draft_vocab(make_draft(), torch.tensor(keep, dtype=torch.long))


@pytest.mark.parametrize("size", [0, VD + 1])
def test_bad_size(size):
    draft = make_draft()
    with pytest.raises(ValueError, match=f"size {size} must be in \\[1, {VD}\\].*can only shrink"):
        shrink_to_frequent(draft, torch.ones(V), size)


def test_counts_must_cover_the_target_vocab():
    draft = make_draft()
    with pytest.raises(ValueError, match="counts of shape \\(10,\\) must be \\[V\\]"):
        shrink_to_frequent(draft, torch.ones(10), 4)


def test_shrunk_draft_saves_and_loads_back(tmp_path):
    draft = make_draft()
    fp = TargetFingerprint(architecture="LlamaForCausalLM", num_layers=8, hidden_size=48, vocab_size=V,
                           tokenizer_sha256="tok", chat_template_sha256="tmpl", weights_sha256="w", dtype="float32")
    contract = HiddenStateContract(aux_boundaries=(2, 4, 5), target=fp)
    small = shrink_to_frequent(draft, torch.arange(V), 8)
    save_draft(tmp_path / "d", small, contract, {"note": "shrunk"})
    assert read_draft_config(tmp_path / "d")["draft"]["draft_vocab_size"] == 8
    loaded, _, _ = load_draft(tmp_path / "d")
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(small.config)
    assert torch.equal(loaded.d2t, small.d2t) and torch.equal(loaded.t2d, small.t2d)
    with torch.no_grad():
        torch.testing.assert_close(step_logits(loaded), step_logits(small))
