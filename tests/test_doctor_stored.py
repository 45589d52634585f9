"""doctor --stored: stored states + the target's head only measure what the full doctor measures."""

from __future__ import annotations

import pytest
import torch

from eaglewire.model.boundary_capture import capture
from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.shards import ShardWriter
from eaglewire.doctor import DoctorConfig, run_doctor
from eaglewire.doctor.stored import stored_layouts, token_signal
from eaglewire.model.target import load_target
from eaglewire.train.loop import train
from eaglewire.train.train_config import TrainConfig
from tiny import save_tiny_dir

AUX = (2, 4, 5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target directory, shards captured from it (fp16), and a draft trained briefly on them."""
    root = tmp_path_factory.mktemp("stored")
    target_dir = save_tiny_dir(root / "target")
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    contract = HiddenStateContract(aux_boundaries=AUX, target=target.fingerprint)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(root / "data", contract, source={"test": True}, dtype="fp16") as w:
        for i in range(24):
            ids = torch.randint(0, 256, (1, 24), generator=g)
            got = capture(target, ids, contract)
            w.add(f"s{i}", ids[0], torch.arange(24) >= 4, got.aux_hidden[0], got.last_hidden[0])
    train(TrainConfig(out=str(root / "draft"), target=str(target_dir), data=str(root / "data"), head_only=True,
                      max_steps=15, lr=3e-3, warmup_steps=2, batch_tokens=256, val_sequences=4, draft_vocab_size=128,
                      ttt_steps=1, eval_interval=15, save_interval=15, device="cpu", skip_label_check=True),
          progress=False)  # a random tiny target on random tokens: the label check cannot judge (test_label_check.py)
    return root, target_dir, target


def doctor_config(root, target_dir, **kw) -> DoctorConfig:
    return DoctorConfig(**{"draft": str(root / "draft"), "target": str(target_dir), "data": str(root / "data"),
                           "include_training": True, "engine_prompts": 0, "min_tokens": 200, "skip_label_check": True, **kw})


def test_stored_doctor_matches_the_full_doctor(setup):
    root, target_dir, target = setup
    full = run_doctor(doctor_config(root, target_dir), target=target)
    stored = run_doctor(doctor_config(root, target_dir, stored=True, json=str(root / "stored.json")))
    assert full.accuracy["acc@0"] > 0  # a draft that predicts something, so equality means something
    assert abs(full.accuracy["acc@0"] - stored.accuracy["acc@0"]) <= 0.005
    assert stored.facts["judged tokens"] == full.facts["judged tokens"]
    skipped = next(c for c in stored.checks if c.name == "skipped")
    assert "needs the target to run" in skipped.summary
    assert stored.exit_code == 0, stored.render()
    # --json records the resolved config, and --config reads it back from the report
    from eaglewire.core.configs import config_from_mapping, load_config_file

    assert config_from_mapping(DoctorConfig, load_config_file(root / "stored.json")) == \
        doctor_config(root, target_dir, stored=True, json=str(root / "stored.json"))


def test_labels_tokens_judge_against_the_stored_next_tokens(setup):
    root, target_dir, _ = setup
    report = run_doctor(doctor_config(root, target_dir, stored=True, labels="tokens"))
    assert any(c.name == "labels" for c in report.checks)
    assert 0.0 <= report.accuracy["acc@0"] <= 1.0


def test_token_signal_is_the_next_token():
    ids = torch.tensor([[5, 7, 9, 2]])
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[2, 7, 9]] = True  # draft ids 0, 1, 2
    needed = torch.tensor([[True, True, True, False]])
    sig = token_signal(ids, needed, torch.tensor([2, 7, 9]), t2d)
    assert sig.argmax[0, :3].tolist() == [7, 9, 2]
    assert sig.probs[0, :3].argmax(-1).tolist() == [1, 2, 0] and sig.probs[0, 3].sum() == 0
    assert sig.in_vocab[0].tolist() == [True, True, True, False]


def test_layouts_are_every_ordered_choice_of_the_stored():
    layouts = stored_layouts([0, 2, 4, 6], 3, [0, 2, 4], {"sglang": [2, 4, 6], "other": [1, 2, 3]})
    assert len(layouts) == 4 * 3 * 2
    assert layouts[(0, 2, 4)][0] == "declared" and layouts[(2, 4, 6)][0] == "sglang"
    assert (1, 2, 3) not in layouts  # not stored: cannot be measured


def test_stored_needs_data(setup):
    root, target_dir, _ = setup
    with pytest.raises(ValueError, match="--compare-data and --labels read stored states: add --stored"):
        DoctorConfig(draft="d", labels="tokens")
    with pytest.raises(ValueError, match="--stored measures on stored states: pass --data"):
        run_doctor(DoctorConfig(draft=str(root / "draft"), target=str(target_dir), stored=True))


def test_doctor_takes_a_foreign_draft_and_states_its_reading(setup, tmp_path):
    import json

    from eaglewire.engines import export_draft

    root, target_dir, target = setup
    export_draft(root / "draft", "sglang", tmp_path / "sg")
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    config.pop("eaglewire")  # as SGLang / SpecForge write it: no contract
    (tmp_path / "sg" / "config.json").write_text(json.dumps(config))
    native = run_doctor(doctor_config(root, target_dir, stored=True))
    for stored in (False, True):
        cfg = doctor_config(root, target_dir, stored=stored)
        cfg.draft = str(tmp_path / "sg")
        report = run_doctor(cfg, target=None if stored else target)
        check = next(c for c in report.checks if c.name == "draft format")
        assert "specforge draft (detected): config ids [1, 3, 4]" in check.summary and "[2, 4, 5]" in check.summary
        assert abs(report.accuracy["acc@0"] - native.accuracy["acc@0"]) <= 0.005


def test_drift_between_two_stored_captures(setup, tmp_path):
    from eaglewire.data.shards import ShardDataset

    root, target_dir, _ = setup
    ds = ShardDataset(root / "data")
    g = torch.Generator().manual_seed(3)
    for name, noise in (("same", 0.0), ("noisy", 0.5)):
        with ShardWriter(tmp_path / name, ds.contract, source={"test": name}, dtype="fp16") as w:
            for sid, item in zip(ds.sequence_ids, ds):
                aux = item["aux_hidden"].float()
                aux[:, 64:128] += noise * aux[:, 64:128].std() * torch.randn(aux.shape[0], 64, generator=g)  # boundary 4
                w.add(sid, item["input_ids"], item["loss_mask"], aux, item["last_hidden"])
    reports = {name: run_doctor(doctor_config(root, target_dir, stored=True, compare_data=str(tmp_path / name)))
               for name in ("same", "noisy")}
    same, noisy = (next(c for c in reports[n].checks if c.name == "capture drift") for n in ("same", "noisy"))
    assert same.verdict == "ok" and "24 sequences captured twice" in same.summary
    assert noisy.verdict == "fail" and any(e.startswith("boundary 4: cosine 0.8") for e in noisy.evidence)
    assert any(e.startswith("boundary 2: cosine 1.0") for e in noisy.evidence)


def rewrite(ds, out, target, **storage) -> None:
    """The stored sequences of ``ds`` written again with other storage (the target's head gives top-K labels)."""
    with ShardWriter(out, ds.contract, source={"test": "rewritten"}, dtype="fp16",
                     labels_head=lambda h: target.head(h.float()), **storage) as w:
        for sid, item in zip(ds.sequence_ids, ds):
            w.add(sid, item["input_ids"], item["loss_mask"], item["aux_hidden"], item["last_hidden"])


def test_stored_doctor_on_topk_labels_judges_against_their_top_1(setup, tmp_path):
    from eaglewire.data.shards import ShardDataset

    root, target_dir, target = setup
    ds = ShardDataset(root / "data")
    rewrite(ds, tmp_path / "topk_all", target, labels="topk:256")  # K = V: the top-1 is the head's argmax
    rewrite(ds, tmp_path / "compact", target, state_dtype="fp8", labels="topk:8")
    hidden = run_doctor(doctor_config(root, target_dir, stored=True))
    reports = {name: run_doctor(doctor_config(root, target_dir, stored=True, data=str(tmp_path / name)))
               for name in ("topk_all", "compact")}
    for name, report in reports.items():
        labels = next(c for c in report.checks if c.name == "labels")
        assert "top-1 of the stored target labels" in labels.summary and "topk:" in labels.summary
        assert report.exit_code == 0, report.render()
    # the same aux states and the same argmax (the head on the same fp16 state): the same count
    assert reports["topk_all"].accuracy["acc@0"] == hidden.accuracy["acc@0"]
    assert reports["topk_all"].facts["judged tokens"] == hidden.facts["judged tokens"]
    # fp8 aux states move each value by at most 2^-4 of its token's amax: the draft still agrees
    assert abs(reports["compact"].accuracy["acc@0"] - hidden.accuracy["acc@0"]) <= 0.05
    drift = run_doctor(doctor_config(root, target_dir, stored=True, compare_data=str(tmp_path / "compact")))
    check = next(c for c in drift.checks if c.name == "capture drift")
    assert [e.split(":")[0] for e in check.evidence[:3]] == ["boundary 2", "boundary 4", "boundary 5"]
    assert not any(e.startswith("boundary 8") for e in check.evidence)  # no last state to compare


def test_capture_drift_against_topk_shards_compares_the_aux_states_only(setup, tmp_path):
    """What the full doctor does with held-out shards (doctor/doctor_command.py): their stored states beside a
    fresh capture; top-K shards hold no last state, so boundary L is not compared."""
    from eaglewire.data.shards import ShardDataset
    from eaglewire.doctor.measure import Sequence, capture_batches, capture_drift
    from eaglewire.model.checkpoint import load_draft

    root, target_dir, target = setup
    rewrite(ShardDataset(root / "data"), tmp_path / "compact", target, state_dtype="fp8", labels="topk:8")
    ds = ShardDataset(tmp_path / "compact")
    seqs = [Sequence(ds.sequence_ids[i], ds[i]["input_ids"], ds[i]["loss_mask"], ds[i]["aux_hidden"],
                     ds[i].get("last_hidden")) for i in range(4)]
    draft, _, _ = load_draft(root / "draft", target=target)
    batches = capture_batches(target, draft, seqs, list(AUX))
    assert batches[0].stored_aux is not None and batches[0].stored_last is None
    drifts = capture_drift(batches, list(AUX), target.num_layers)
    assert [d.boundary for d in drifts] == list(AUX)
    assert all(d.cosine > 0.99 for d in drifts)  # fp8 moves each value by at most 2^-4 of its token's amax
