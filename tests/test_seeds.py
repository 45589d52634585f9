"""The seeds' case end to end, the target never run: a DeepSeek-V3 target, four states stored in
speculators' layout, a draft trained on the first three, and the SGLang config they served.

Everything eaglewire touches of the target is its head (``target_head.py``: its layers stay on
the meta device, so running them would raise), and the states are written here, standing in for
the tool that captured them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglewire.data.import_data import ImportDataConfig, import_data
from eaglewire.doctor import DoctorConfig, run_doctor
from eaglewire.engines.registry import export_draft
from eaglewire.model.target_head import load_target_head
from eaglewire.train.loop import train
from eaglewire.train.train_config import TrainConfig
from tiny import save_tiny_dir

L, H = 8, 64
STORED = [0, 2, 4, 6]  # [embedding, b1, b2, b3], as the seeds' [0, 3, 31, 59]
FIRST3, LAST3 = STORED[:3], STORED[1:]


def write_speculators_capture(src: Path, rows: Path, *, n: int = 24, T: int = 32) -> None:
    """hs_{i}.safetensors [T, 5, H]: the four stored states, then the verifier's last state (boundary L).

    The next token depends on the embedding capture alone (the last state is a copy of it), so a
    draft trained on [0, b1, b2] reads its first slot and one fed [b1, b2, b3] reads noise.
    """
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    with open(rows, "w") as f:
        for i in range(n):
            states = torch.randn(T, len(STORED), H, generator=g)  # [T, 4, H]
            last = 4 * states[:, 0]  # [T, H]
            save_file({"hidden_states": torch.cat([states, last[:, None]], dim=1)},  # [T, 5, H]
                      str(src / f"hs_{i}.safetensors"))
            ids = torch.randint(0, 256, (T,), generator=g).tolist()
            f.write(json.dumps({"id": f"conv-{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * (T - 4)}) + "\n")


def sglang_config(draft: Path, path: Path, ids: list[int]) -> Path:
    """The draft exported for SGLang (every field as the export writes it), with the served ids written
    by hand: SGLang's deepseek_v2.py adds +1 to every id only when the first id is 1, otherwise takes
    the ids verbatim, and its layer-i capture is the input of layer i = boundary i."""
    export_draft(draft, "sglang", path)
    config = json.loads((path / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (path / "config.json").write_text(json.dumps(config))
    return path / "config.json"


def doctor(draft: Path, data: Path, target: Path, engine_config: Path):
    # the contract records the target's architecture (deepseek_v3), which picks SGLang's deepseek_v2.py reading
    return run_doctor(DoctorConfig(draft=str(draft), target=str(target), data=str(data), stored=True,
                                   engine="sglang", engine_config=str(engine_config), include_training=True,
                                   min_tokens=100, skip_label_check=True))  # the states are synthetic  # 24 short rows: ~170 judged tokens


def test_seeds_first_three_trained_last_three_served(tmp_path, monkeypatch):
    target = save_tiny_dir(tmp_path / "target", "deepseek_v3", num_layers=L, hidden_size=H)
    head = load_target_head(str(target))
    assert sum(not p.is_meta for p in head.layers.parameters()) == 1  # only the tensor the fingerprint hashes

    def never(*args, **kwargs):
        raise AssertionError("a target layer ran")

    monkeypatch.setattr(type(head.layers[0]), "forward", never)
    monkeypatch.setattr(type(head.layers[-1]), "forward", never)  # MoE layers are another class
    # the seeds' target is too large to load: import-data's boundary identification leaves it unloaded (auto)
    monkeypatch.setattr("eaglewire.data.import_data.IDENTIFY_MAX_BYTES", 0)
    write_speculators_capture(tmp_path / "capture", tmp_path / "rows.jsonl")
    common = dict(src=str(tmp_path / "capture"), layout="speculators", target=str(target),
                  boundaries=[*STORED, L], tokens=str(tmp_path / "rows.jsonl"), skip_label_check=True)
    import_data(ImportDataConfig(out=str(tmp_path / "first3"), aux_boundaries=FIRST3, **common))
    import_data(ImportDataConfig(out=str(tmp_path / "stored"), **common))  # every stored state
    train(TrainConfig(out=str(tmp_path / "draft"), target=str(target), data=str(tmp_path / "first3"),
                      head_only=True, max_steps=40, lr=3e-3, warmup_steps=2, batch_tokens=256, val_sequences=4,
                      draft_vocab_size=64, ttt_steps=1, eval_interval=40, save_interval=40, device="cpu",
                      skip_label_check=True),
          progress=False)

    served = doctor(tmp_path / "draft", tmp_path / "stored", target, sglang_config(tmp_path / "draft", tmp_path / "sg", LAST3))
    assert served.exit_code != 0
    check = next(c for c in served.checks if c.name == "trained vs served")
    assert check.verdict == "fail" and f"trained on {FIRST3}" in check.summary and f"will feed {LAST3}" in check.summary
    assert check.fix.startswith("either ") and "--aux-boundaries 2,4,6" in check.fix and "retrain" in check.fix
    assert "[0, 2, 4]" in check.fix  # deepseek_v2.py takes ids verbatim unless the first is 1: the embedding is id 0

    fixed = doctor(tmp_path / "draft", tmp_path / "stored", target, sglang_config(tmp_path / "draft", tmp_path / "ok", FIRST3))
    assert [c.name for c in fixed.checks if c.verdict == "fail"] == [], fixed.render()
    assert fixed.exit_code == 0
