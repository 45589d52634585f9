"""Foreign draft directories used directly: detected, converted in memory, their reading stated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglewire.model.checkpoint import save_draft
from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.shards import ShardWriter
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.engines.formats.foreign_draft import detect_draft_format, load_any_draft
from eaglewire.engines import export_draft
from eaglewire.train.loop import train
from eaglewire.train.train_config import TrainConfig
from tiny import tiny_target

AUX, VD = (2, 4, 5), 64


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=8, hidden_size=64, initializer_range=0.2)


def native(out: Path, target) -> tuple[Path, Eagle3Draft]:
    cfg = DraftConfig.from_target(target.text_config, num_aux=len(AUX), draft_vocab_size=VD,
                                  vocab_size=target.vocab_size)
    torch.manual_seed(1)
    draft = Eagle3Draft(cfg)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[::4] = True  # every 4th token: d2t[i] = 4i - i
    draft.set_vocab(torch.arange(VD) * 3, t2d)
    contract = HiddenStateContract(aux_boundaries=AUX, target=target.fingerprint)
    return save_draft(out, draft, contract, {"target": "tiny"}), draft


def strip_record(path: Path) -> Path:
    """What SGLang / SpecForge / speculators themselves write: no eaglewire contract."""
    config = json.loads((path / "config.json").read_text())
    config.pop("eaglewire")
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("to, fmt, ids", [("sglang", "specforge", [1, 3, 4]), ("speculators", "speculators", [2, 4, 5])])
def test_foreign_draft_loads_as_the_native_one(tmp_path, target, to, fmt, ids):
    path, draft = native(tmp_path / "native", target)
    export_draft(path, to, tmp_path / "foreign", target=target, verifier_name="org/tiny")
    foreign = strip_record(tmp_path / "foreign")
    assert detect_draft_format(path) == "native" and detect_draft_format(foreign) == fmt
    loaded, contract, _, notes = load_any_draft(foreign, target=target)
    assert contract.aux_boundaries == AUX and contract.target == target.fingerprint
    want = draft.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k].to(v.dtype)), k
    assert notes[0].startswith(f"{foreign} is a {fmt} draft (detected): config ids {ids}")
    assert f"boundaries {list(AUX)}" in notes[0]


def test_train_init_draft_accepts_a_foreign_directory(tmp_path, target):
    path, _ = native(tmp_path / "native", target)
    export_draft(path, "sglang", tmp_path / "sg")
    foreign = strip_record(tmp_path / "sg")
    contract = HiddenStateContract(aux_boundaries=AUX, target=target.fingerprint)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(tmp_path / "data", contract, source={"test": True}) as w:
        for i in range(6):
            w.add(f"s{i}", torch.randint(0, 256, (12,), generator=g), torch.ones(12, dtype=torch.bool),
                  torch.randn(12, 3 * 64, generator=g), torch.randn(12, 64, generator=g))
    cfg = TrainConfig(out=str(tmp_path / "out"), data=str(tmp_path / "data"), init_draft=str(foreign),
                      max_steps=1, batch_tokens=64, val_sequences=1, draft_vocab_size=VD, ttt_steps=1,
                      eval_interval=1, save_interval=1, device="cpu")
    result = train(cfg, target=target, progress=False)
    assert result.steps == 1
    stored = json.loads((tmp_path / "out" / "config.json").read_text())
    assert stored["training"]["init_draft"][-1]["draft"] == str(foreign)
