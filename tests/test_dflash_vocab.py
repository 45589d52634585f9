"""DFlash drafts over a pruned vocabulary (`train --family dflash --draft-vocab-size N`): the N most frequent reply
tokens' rows of the target's head, as speculators' --draft-vocab-size; trained, decoded losslessly, judged by the
doctor, refused by the exports that do not carry the maps yet."""

from __future__ import annotations

import pytest
import torch

from eaglewire import engines
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.doctor import DoctorConfig, run_doctor
from eaglewire.engines.formats.eagle3_layout import FormatError
from eaglewire.model.checkpoint import load_draft
from eaglewire.model.dflash import DFlashConfig, DFlashDraft
from eaglewire.model.dflash_blocks import draft_head, draft_lm_head, target_lm_head
from eaglewire.model.dflash_objective import block_signal
from eaglewire.train.loop import train
from eaglewire.train.train_config import TrainConfig
from tiny import pruned_dflash_draft, random_dflash_draft, sharp_shards, tiny_target

AUX = (2, 4, 5)
VOCAB, COMMON, DRAFT_VOCAB = 32, 8, 10  # replies mostly use ids 0..7, a few others: the draft keeps ten rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-vocab")

    def replies(g):  # mostly ids 0..7, two rarer ones a sequence
        ids = torch.randint(0, COMMON, (1, 24), generator=g)
        ids[0, torch.randint(0, 24, (2,), generator=g)] = torch.randint(COMMON, VOCAB - 1, (2,), generator=g)
        return ids

    target_dir, target = sharp_shards(root, VOCAB, AUX, replies)
    train(TrainConfig(out=str(root / "draft"), target=str(target_dir), data=str(root / "data"), family="dflash",
                      draft_vocab_size=DRAFT_VOCAB, block_size=4, draft_layers=1, anchors_per_sequence=16, epochs=20,
                      mask_token_id=VOCAB - 1, lr=5e-3, warmup_steps=2, batch_tokens=256, val_sequences=4,
                      eval_interval=1000, save_interval=1000, device="cpu", skip_label_check=True), progress=False)
    return root, target_dir, target


def test_training_keeps_the_most_frequent_reply_tokens_and_saves_the_maps(trained):
    root, _, target = trained
    draft, contract, meta = load_draft(root / "draft", target=target)
    assert draft.config.pruned and draft.config.draft_vocab_size == DRAFT_VOCAB
    kept = draft.draft_to_target.tolist()
    assert kept == sorted(kept) and set(range(COMMON)) <= set(kept)  # the common ids, then the most seen rare ones
    assert draft.t2d.sum() == DRAFT_VOCAB and draft.t2d[draft.draft_to_target].all()
    assert {"d2t", "t2d"} <= set(draft.state_dict())


def test_the_head_computes_only_the_draft_s_rows():
    """The draft's logits are the target head's at its rows (the same dot products: a row subset, so equal to
    float rounding), and -inf elsewhere when read over the target's vocabulary."""
    target = tiny_target("llama", num_layers=8, hidden_size=64, vocab_size=VOCAB)
    draft = pruned_dflash_draft(random_dflash_draft(target, AUX, block_size=4)[0], [0, 3, 4, 9, 20])
    h = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    full = target_lm_head(target)(h)  # [6, V]
    rows = torch.tensor([0, 3, 4, 9, 20])
    torch.testing.assert_close(draft_head(target, draft)(h), full[:, rows], rtol=1e-5, atol=1e-5)
    over_v = draft_lm_head(target, draft)(h)  # [6, V]
    assert torch.isinf(over_v[:, [i for i in range(VOCAB) if i not in rows]]).all()
    torch.testing.assert_close(over_v[:, rows], full[:, rows], rtol=1e-5, atol=1e-5)


def test_the_signal_counts_only_pairs_the_vocabulary_can_draft():
    """A pair whose target argmax lies outside the draft vocabulary is not counted (as EAGLE-3's); the rest get the
    target's distribution renormalised over the draft ids."""
    V, keep_ids = 6, torch.tensor([0, 2, 3])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep_ids] = True
    argmax_at = torch.tensor([0, 1, 2, 5, 3, 3, 0, 2])  # the target's argmax at each of 8 positions
    last = torch.nn.functional.one_hot(argmax_at, V).float()[None] * 5  # [1, 8, V]: the "head" is the identity
    mask = torch.ones(1, 8, dtype=torch.bool)
    full = block_signal(mask, anchors_per_row=8, block_size=3, head=lambda x: x, last_hidden=last, vocab_size=V,
                        generator=torch.Generator().manual_seed(0))
    pruned = block_signal(mask, anchors_per_row=8, block_size=3, head=lambda x: x, last_hidden=last, vocab_size=V,
                          generator=torch.Generator().manual_seed(0), vocab=(keep_ids, t2d))
    assert torch.equal(pruned.anchors, full.anchors)  # the same blocks
    assert int(pruned.counted.sum()) == int(t2d[full.argmax].sum()) < int(full.counted.sum())
    assert t2d[pruned.argmax].all() and pruned.probs.shape[1] == 3
    torch.testing.assert_close(pruned.probs.sum(-1), torch.ones(len(pruned.probs)))


@pytest.mark.parametrize("spec", [SpecConfig.chain(3), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)])
def test_greedy_decoding_with_a_pruned_draft_is_plain_greedy(trained, spec):
    _, _, target = trained
    draft, contract, _ = load_draft(trained[0] / "draft", target=target)
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, COMMON, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = SpecDecoder(target).generate(prompt, max_new_tokens=16)
        out, stats = SpecDecoder(target, draft, contract, spec).generate(prompt, max_new_tokens=16)
        assert out == plain, f"seed {seed}"
        accepted += sum(stats.accept_lengths) - stats.rounds
    assert accepted > 0  # the drafts were kept: the rows were mapped back to the right target ids


def test_the_doctor_measures_a_pruned_draft(trained):
    root, target_dir, target = trained
    report = run_doctor(DoctorConfig(draft=str(root / "draft"), target=str(target_dir), data=str(root / "data"),
                                     include_training=True, engine_prompts=1, engine_tokens=8, min_tokens=200,
                                     skip_label_check=True, tune=False), target=target)
    checks = {c.name: c for c in report.checks}
    assert report.accuracy["acc@0"] > 0.2, report.render()
    assert checks["layout sweep"].verdict == "ok" and checks["acceptance"].verdict in ("ok", "inconclusive")


def test_exports_without_maps_refuse_a_pruned_draft_and_vllm_s_carries_them(trained, tmp_path):
    """z-lab's layout (SGLang) carries no d2t: refused, naming what works; speculators' layout (vLLM) writes the
    maps and the target head's rows (read back by speculators' own loader in tests/engines/test_speculators_dflash.py;
    llama.cpp's GGUF in tests/engines/test_llamacpp_dflash.py)."""
    root, _, target = trained
    for to in ("zlab", "sglang"):
        with pytest.raises(FormatError, match="--to vllm or --to llamacpp"):
            engines.export_draft(root / "draft", to, tmp_path / to, target=target, target_arch="llama")
        assert not (tmp_path / to).exists()
    engines.export_draft(root / "draft", "vllm", tmp_path / "vllm", target=target, target_arch="llama")
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "vllm" / "model.safetensors")
    draft, _, _ = load_draft(root / "draft", target=target)
    assert torch.equal(tensors["lm_head.weight"], target.model.lm_head.weight.detach()[draft.draft_to_target])
    assert torch.equal(tensors["d2t"], draft.d2t) and torch.equal(tensors["t2d"], draft.t2d)


def test_a_whole_vocabulary_config_reads_as_before():
    """A config written before the field existed reads as the whole vocabulary, with no maps stored."""
    target = tiny_target("llama", num_layers=8, hidden_size=64, vocab_size=VOCAB)
    draft, _ = random_dflash_draft(target, AUX, block_size=4)
    old = {k: v for k, v in draft.config.to_dict().items() if k != "draft_vocab_size"}
    config = DFlashConfig.from_dict(old)
    assert config == draft.config and not config.pruned
    assert not {"d2t", "t2d"} & set(DFlashDraft(config).state_dict())
