"""The doctor's measured checks on DFlash drafts: accuracy per drafted position as decoding drafts, the
layout sweep telling the layout a block draft was trained on, drift, the engine against the replay, and
--stored from stored states alone."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from eaglewire.doctor import DoctorConfig, run_doctor
from eaglewire.doctor.measure import Sequence, capture_batches, engine_agreement, isolation_accuracy
from eaglewire.model.boundary_capture import capture
from eaglewire.model.checkpoint import load_draft, save_draft
from eaglewire.model.dflash_blocks import target_lm_head
from eaglewire.train.loop import train
from eaglewire.train.train_config import TrainConfig
from test_dflash_acceptance import decode_block
from tiny import random_dflash_draft, sharp_shards, tiny_target

AUX = (2, 4, 5)
VOCAB = 16  # few tokens: a briefly trained block draft learns the tiny target's argmax


# ------------------------------------------------------------------ against decoding, block by block

def target_argmax(target, text):
    return target.head(capture(target, torch.tensor([text]), [2]).last_hidden[0]).argmax(-1).tolist()  # [T]


def test_isolation_counts_per_drafted_position_are_decodings_blocks():
    """acc@j (drafted position j + 1) counts, at every anchor of the replies, whether the block decoded
    from the context cache before its anchor drafts the target's own token there."""
    target = tiny_target("llama", initializer_range=0.2, vocab_size=6)
    draft, contract = random_dflash_draft(target, block_size=4, num_layers=1, seed=1)
    layout = list(contract.aux_boundaries)
    texts = [torch.randint(0, 6, (20,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    seqs = [Sequence(f"s{i}", torch.tensor(t), torch.arange(len(t)) >= 6) for i, t in enumerate(texts)]
    counts = isolation_accuracy(draft, capture_batches(target, draft, seqs, layout), layout, steps=3)
    valid, correct = [0] * 3, [0] * 3
    for text in texts:
        best = target_argmax(target, text)
        for a in range(len(text)):
            drafted = decode_block(target, draft, layout, text, a, 4)[0] if a < len(text) - 1 else None
            for j in range(1, 4):  # position j predicts x_{a+j}, judged by the target at a + j - 1
                if a + j < len(text) and a + j >= 6:
                    valid[j - 1] += 1
                    correct[j - 1] += int(int(drafted[j - 1]) == best[a + j - 1])
    assert [c.valid for c in counts] == valid
    assert [c.correct for c in counts] == correct and sum(correct) > 0


class BlockDecoder:
    """Greedy DFlash decoding for the test (eaglewire's engine decodes EAGLE-3 here): the anchor is the
    last token the target produced (``stale``: the one before it, an engine that lost the bonus token), the
    block reads the states before it, the target keeps the drafts matching its own tokens, then its bonus."""

    def __init__(self, target, draft, layout, n, stale=False):
        self.target, self.draft, self.layout, self.n, self.stale = target, draft, layout, n, stale
        self.spec = SimpleNamespace(topk=1, num_steps=n)

    def generate(self, prompt, *, max_new_tokens, stop_token_ids=None):
        text = list(prompt) + [target_argmax(self.target, prompt)[-1]]
        lengths = []
        while len(text) - len(prompt) < max_new_tokens:
            p = len(text) - 1
            drafted = self._draft(text, p)
            best = target_argmax(self.target, text + drafted)
            m = 0
            while m < self.n and drafted[m] == best[p + m]:
                m += 1
            text += drafted[:m] + [best[p + m]]
            lengths.append(m + 1)
        return text[len(prompt):], SimpleNamespace(accept_lengths=lengths)

    def _draft(self, text, p):
        draft, L = self.draft, self.target.num_layers
        with torch.no_grad():
            aux = capture(self.target, torch.tensor([text[:p]]), [b for b in self.layout if b != L]).aux_hidden.float()
            ctx = draft.fuse(aux)  # [1, p, H]
            cache = draft.context_kv(ctx, torch.arange(p)[None])
            anchor = text[p - 1] if self.stale else text[p]
            emb = self.target.embed_tokens(torch.tensor([[anchor, draft.config.mask_token_id]])).float()
            hidden = draft.draft_block(emb[:, 0], emb[0, 1], p, cache)[0, :self.n]  # [n, H]
        return target_lm_head(self.target)(hidden).argmax(-1).tolist()


def test_the_engine_agrees_with_the_block_replay_and_a_stale_anchor_does_not():
    """engine_agreement replays a block decoder's rounds on the block trace of the text it produced: every
    round agrees, and a decoder anchoring its blocks on the token before the bonus disagrees. (A 4-token
    vocabulary, so a random draft has tokens accepted.)"""
    target = tiny_target("llama", initializer_range=0.2, vocab_size=4)
    draft, contract = random_dflash_draft(target, block_size=4, num_layers=1, seed=1)
    layout = list(contract.aux_boundaries)
    prompts = [torch.randint(0, 4, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    right = [engine_agreement(BlockDecoder(target, draft, layout, 3), draft, layout, p, max_new_tokens=16)
             for p in prompts]
    assert all(r.share == 1.0 for r in right) and sum(r.rounds for r in right) >= 6
    assert sum(r.measured_tokens - r.rounds for r in right) > 0  # something accepted: agreement means something
    wrong = [engine_agreement(BlockDecoder(target, draft, layout, 3, stale=True), draft, layout, p, max_new_tokens=16)
             for p in prompts]
    assert sum(r.agree for r in wrong) < sum(r.rounds for r in wrong)


# ------------------------------------------------------------------ the doctor on a trained block draft

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target directory, shards of its states at boundaries 1..6 and AUX, and a DFlash draft
    trained briefly on AUX."""
    root = tmp_path_factory.mktemp("dflash-doctor")
    # VOCAB - 1: the mask token, never in the data
    target_dir, target = sharp_shards(root, VOCAB, AUX, lambda g: torch.randint(0, VOCAB - 1, (1, 24), generator=g))
    train(TrainConfig(out=str(root / "draft"), target=str(target_dir), data=str(root / "data"), family="dflash",
                      block_size=4, draft_layers=1, anchors_per_sequence=16, epochs=60, mask_token_id=VOCAB - 1, lr=5e-3, warmup_steps=2,
                      batch_tokens=256, val_sequences=4, eval_interval=1000, save_interval=1000, device="cpu",
                      skip_label_check=True), progress=False)
    return root, target_dir, target


def doctor_config(root, target_dir, draft="draft", **kw) -> DoctorConfig:
    return DoctorConfig(**{"draft": str(root / draft), "target": str(target_dir), "data": str(root / "data"),
                           "include_training": True, "engine_prompts": 1, "engine_tokens": 8, "min_tokens": 200,
                           "skip_label_check": True, **kw})


def test_the_doctor_passes_a_dflash_draft_on_its_layout_and_stored_agrees(trained):
    root, target_dir, target = trained
    full = run_doctor(doctor_config(root, target_dir), target=target)
    checks = {c.name: c for c in full.checks}
    assert full.accuracy["acc@0"] > 0.2, full.render()  # it learned: the sweep can tell layouts apart
    assert list(full.accuracy) == ["acc@0", "cond acc@1", "cond acc@2"]  # block_size 4: three drafted positions
    assert checks["layout sweep"].verdict == "ok" and checks["alignment"].verdict == "ok", full.render()
    assert checks["capture drift"].verdict == "ok"  # fp16 shards against fp32 states now
    # the engine's rounds against the replay: ok, or inconclusive when this briefly trained draft accepts nothing
    assert checks["acceptance"].verdict in ("ok", "inconclusive"), checks["acceptance"]
    assert "drafted from one block" in " ".join(checks["speed"].evidence)  # tune's ranking of block shapes
    stored = run_doctor(doctor_config(root, target_dir, stored=True))
    assert abs(stored.accuracy["acc@0"] - full.accuracy["acc@0"]) <= 0.005  # fp16 stored states vs fp32 now
    assert stored.facts["judged tokens"] == full.facts["judged tokens"]
    assert {c.name: c for c in stored.checks}["layout sweep"].verdict == "ok", stored.render()


def test_the_sweep_names_the_layout_a_dflash_draft_was_trained_on(trained):
    """The draft trained on [2, 4, 5] with a contract saying [3, 5, 6] (every boundary one off): the sweep
    finds [2, 4, 5] better beyond noise and names it in the fix."""
    root, target_dir, target = trained
    draft, contract, meta = load_draft(root / "draft", target=target)
    save_draft(root / "mislabeled", draft, replace(contract, aux_boundaries=(3, 5, 6)), meta.get("training"))
    report = run_doctor(doctor_config(root, target_dir, draft="mislabeled", tune=False), target=target)
    checks = {c.name: c for c in report.checks}
    acc = {tuple(r.layout): r.acc0 for r in report.layouts}
    assert acc[(2, 4, 5)] == max(acc.values()) and acc[(2, 4, 5)] > acc[(3, 5, 6)], acc
    assert checks["layout sweep"].verdict == "fail" and "2,4,5" in checks["layout sweep"].fix


def test_a_dflash_wiring_fix_names_the_dflash_key_and_applied_passes(trained):
    """A vLLM DFlash export whose ids were edited one off: the wiring check and the layout sweep FAIL with the key
    vLLM reads for DFlash drafts (the sweep used to print EAGLE-3's eagle_aux_hidden_state_layer_ids); the key
    written as printed, both pass."""
    import json
    import re

    from eaglewire.engines import export_draft

    root, target_dir, target = trained
    export_draft(root / "draft", "vllm", root / "vllm", target=target)
    path = root / "vllm" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "aux_hidden_state_layer_ids": [b + 1 for b in AUX]}))

    def checks():
        report = run_doctor(doctor_config(root, target_dir, engine="vllm", engine_config=str(path), tune=False,
                                          engine_prompts=0), target=target)
        return {c.name: c for c in report.checks}

    failed = checks()
    assert failed["engine wiring"].verdict == "fail" and failed["layout sweep"].verdict == "fail"
    for name in ("engine wiring", "layout sweep"):
        assert "eagle_aux" not in failed[name].fix and '"aux_hidden_state_layer_ids": [2, 4, 5]' in failed[name].fix
    key, value = re.search(r'write "(\w+)": (\[[^\]]*\])', failed["layout sweep"].fix).groups()
    path.write_text(json.dumps({**json.loads(path.read_text()), key: json.loads(value)}))
    fixed = checks()
    assert fixed["engine wiring"].verdict == "ok" and fixed["layout sweep"].verdict == "ok", fixed["layout sweep"]
