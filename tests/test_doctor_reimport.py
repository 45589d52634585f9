"""After a misread import, the doctor's fix is the re-import, and retraining only for a draft trained on the misread
shards (issue 64, item 4). A checkpoint records the data it was trained on as the directory `train --data` read
(``training.data``; no content hash of the shards): a draft whose record names these shards is retrained on the
re-imported ones, a draft trained elsewhere (the shipped reference) needs nothing more, and a draft that records no
training data (a foreign one) is told on what condition to retrain."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from eaglewire.data.engine_capture import states_here
from eaglewire.data.import_data import ImportDataConfig, import_data
from eaglewire.data.label_check import POST_NORM
from eaglewire.doctor import DoctorConfig, run_doctor
from eaglewire.doctor.stored import trained_on
from eaglewire.model.target import load_target
from tiny import save_random_draft, save_tiny_dir

L, H = 8, 64
TRUE = [2, 4, 6]  # what the capture holds: SpecForge ids 1, 3, 5, imported as boundaries [1, 3, 5]
ELSEWHERE = "/elsewhere/sharegpt-5k"  # where the reference draft records it was trained


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Shards imported one layer off (as before the identification), and drafts with three training records."""
    root = tmp_path_factory.mktemp("reimport")
    target_dir = save_tiny_dir(root / "target", num_layers=L, hidden_size=H)
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    src = root / "specforge" / "rows_0-4"
    src.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        ids = torch.randint(0, 256, (12 + 2 * i,), generator=g)
        every = states_here(target, ids.tolist())
        with torch.no_grad():
            post = target.decoder.norm(every[L])  # [T, H] after the final norm, as SpecForge stores it
        torch.save({"input_ids": ids[None], "loss_mask": torch.ones(1, len(ids), dtype=torch.long),
                    "hidden_state": post[None], "aux_hidden_state": torch.cat([every[b] for b in TRUE], -1)[None]},
                   src / f"data_{i}.ckpt")
    import_data(ImportDataConfig(src=str(root / "specforge"), layout="specforge", out=str(root / "data"),
                                 target=str(target_dir), boundaries=[1, 3, 5], identify_boundaries="no",
                                 skip_label_check=True))
    for name, training in (("here", {"data": str(root / "data")}), ("elsewhere", {"data": ELSEWHERE}),
                           ("foreign", {})):
        config = save_random_draft(root / name, target, aux_boundaries=(1, 3, 5)) / "config.json"
        config.write_text(json.dumps(json.loads(config.read_text()) | {"training": training}))
    return root


def doctor(root: Path, draft: str, **kw):
    return run_doctor(DoctorConfig(**{"draft": str(root / draft), "target": str(root / "target"),
                                      "data": str(root / "data"), "include_training": True, "engine_prompts": 0,
                                      "min_tokens": 1, "tune": False, "skip_label_check": True, **kw}))


def test_the_training_record_says_whether_the_draft_read_these_shards(tmp_path):
    assert trained_on({"data": str(tmp_path / "data")}, str(tmp_path / "x" / ".." / "data")) is True
    assert trained_on({"data": ELSEWHERE}, str(tmp_path / "data")) is False
    assert trained_on({"data": "sharegpt"}, str(tmp_path / "data")) is False  # trained online, on conversations
    assert trained_on({}, str(tmp_path / "data")) is None  # a foreign draft records nothing


@pytest.mark.parametrize("draft, retrains", [("here", True), ("elsewhere", False), ("foreign", None)])
def test_the_full_doctor_retrains_only_a_draft_trained_on_the_misread_shards(root, draft, retrains):
    check = next(c for c in doctor(root, draft).checks if c.name == "stored boundaries")
    assert check.verdict == "fail" and check.fix.startswith("re-import them as the boundaries they are: `")
    out = root / "data-reimported"
    if retrains:
        assert check.fix.endswith(f", then retrain the draft on {out} (`eaglewire train --data {out}`): it was "
                                  f"trained on these shards (its training record names {root / 'data'})")
    elif retrains is False:
        assert check.fix.endswith(f"`; that is the whole fix: the draft was trained on {ELSEWHERE}, not on these "
                                  "shards, so it needs no retraining")
    else:
        assert check.fix.endswith(f"; if the draft was trained on these shards (it records no training data), "
                                  f"retrain the draft on {out} (`eaglewire train --data {out}`)")


@pytest.mark.parametrize("draft, retrains", [("here", True), ("elsewhere", False)])
def test_the_stored_doctors_label_check_retrains_only_a_draft_trained_on_them(root, draft, retrains, monkeypatch):
    """A random tiny target cannot judge labels (tests/data/test_label_check.py): the check's verdict is given."""
    failed = types.SimpleNamespace(verdict="fail", message="the head disagrees", diagnosis=POST_NORM,
                                   norm_side_wrong=False)
    monkeypatch.setattr("eaglewire.doctor.stored.check_labels", lambda ds, target: failed)
    check = next(c for c in doctor(root, draft, stored=True, skip_label_check=False).checks
                 if c.name == "label check")
    assert check.verdict == "fail" and check.fix.startswith("re-import (eaglewire import-data) with --last-state")
    assert ("then retrain the draft on the new shards" in check.fix) == retrains
    assert ("that is the whole fix" in check.fix) == (not retrains)
