"""The label check: the target's head on the stored last state against the stored next tokens.

An honest capture passes and a capture whose last stored state is a lower layer is refused with the
figures, by each rule (greedy, the target's own rate, the head's calibration) and at each entry point
(prepare, import-data, train, doctor --stored).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglewire.core.contract import ContractError, HiddenStateContract, validate_aux_boundaries
from eaglewire.data.import_data import ImportDataConfig, import_data
from eaglewire.data.label_check import (CALIBRATION_MAX_GAP, GREEDY_MIN_AGREEMENT, LabelCheckError, check_labels,
                                        judged_positions)
from eaglewire.data.shards import ShardDataset, ShardWriter
from eaglewire.model.boundary_capture import record_boundaries
from eaglewire.model.target import load_target
from tiny import save_tiny_dir

L, AUX = 8, (2, 4, 5)
GREEDY_SOURCE = {"regenerated": True, "regenerate": {"max_new_tokens": 24, "temperature": 0.0}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_dir(tmp_path_factory.mktemp("target"), num_layers=L)
    return path, load_target(str(path), device="cpu", dtype="fp32")


@torch.no_grad()
def greedy_sequences(target, n: int, *, prompt: int = 6, new: int = 24, vocab: int = 256, seed: int = 0):
    """(input_ids [T], loss_mask [T]) pairs: a random prompt, then the target's own greedy reply."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (1, prompt), generator=g)  # [1, prompt]
        for _ in range(new):
            nxt = target.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            ids = torch.cat([ids, nxt], dim=1)
        out.append((ids[0], torch.arange(ids.shape[1]) >= prompt))
    return out


@torch.no_grad()
def states(target, ids: torch.Tensor, bounds: list[int]) -> dict[int, torch.Tensor]:
    """boundary -> [T, H] of one sequence."""
    with record_boundaries(target, bounds) as seen:
        target.decoder(input_ids=ids[None])
    return {b: seen[b][0] for b in bounds}


def write_shards(out: Path, target, seqs, *, last: int, source: dict) -> ShardDataset:
    """Shards whose aux holds AUX and whose 'last' state is boundary ``last`` (L for an honest capture)."""
    contract = HiddenStateContract(aux_boundaries=AUX, target=target.fingerprint)
    with ShardWriter(out, contract, source=source) as w:
        for i, (ids, mask) in enumerate(seqs):
            s = states(target, ids, [*AUX, last])
            w.add(f"s{i}", ids, mask, torch.cat([s[b] for b in AUX], dim=-1), s[last])
    return ShardDataset(out)


@pytest.fixture(scope="module")
def greedy(tiny, tmp_path_factory):
    """Honest and lower-layer captures of the same self-written greedy replies."""
    _, target = tiny
    seqs = greedy_sequences(target, 6)
    root = tmp_path_factory.mktemp("greedy")
    return {name: write_shards(root / name, target, seqs, last=last, source={**GREEDY_SOURCE, "test": name})
            for name, last in (("honest", L), ("lower", L - 2))}


def test_judged_positions_skip_the_last_token_of_each_reply():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])
    # index t judges x_{t+1}: x2, x3 are judged (x4 ends its span), x6 is judged (x7 ends the sequence)
    assert judged_positions(mask).nonzero().flatten().tolist() == [1, 2, 5]


def test_greedy_data_honest_passes_lower_layer_is_refused_with_the_figures(greedy, tiny):
    _, target = tiny
    honest, lower = (check_labels(greedy[k], target, reference=False) for k in ("honest", "lower"))
    assert honest.rule == lower.rule == "greedy"  # read from the manifest's source
    assert honest.verdict == "ok" and honest.stored.agreement >= 0.97, honest.message
    assert lower.verdict == "fail" and lower.stored.agreement < GREEDY_MIN_AGREEMENT
    assert f"at {lower.stored.agreement:.3f} of {lower.stored.positions:,} positions" in lower.message
    assert "boundary L = 8" in lower.message and "--boundaries" in lower.message


def test_the_targets_own_rate_when_it_can_run(greedy, tiny):
    _, target = tiny
    honest, lower = (check_labels(greedy[k], target) for k in ("honest", "lower"))
    assert honest.rule == lower.rule == "reference"
    assert honest.verdict == "ok" and honest.reference.agreement >= 0.97
    assert abs(honest.stored_on_reference.agreement - honest.reference.agreement) <= 0.05  # bf16 storage flips a few
    assert lower.verdict == "fail" and "the target's own forward at" in lower.message


def test_head_only_judges_by_calibration(tiny, tmp_path):
    """A random target is no language model of random text: honest and lower layer look alike, both
    refused; the message names --skip-label-check for that case (the real target separates them:
    test_import_refuses_a_shifted_last_state_and_keeps_the_partial)."""
    _, target = tiny
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(0, 256, (24,), generator=g), torch.arange(24) >= 4) for _ in range(4)]
    ds = write_shards(tmp_path / "random", target, seqs, last=L, source={"test": True})
    check = check_labels(ds, target, reference=False)
    assert check.rule == "calibration" and check.stored.gap > CALIBRATION_MAX_GAP
    assert check.verdict == "fail" and "--skip-label-check" in check.message


def test_aux_boundaries_must_lie_below_L(tiny):
    _, target = tiny
    with pytest.raises(ContractError, match=r"include 8 = L.*below L.*e\.g\. 2,4"):
        HiddenStateContract(aux_boundaries=(2, 4, 8), target=target.fingerprint)
    with pytest.raises(ContractError, match="include 8 = L"):
        validate_aux_boundaries([2, 8], 8)
    assert validate_aux_boundaries([0, 7], 8) == [0, 7]


def test_prepare_refuses_aux_boundaries_with_L(tiny, tmp_path):
    from eaglewire.data.prepare import PrepareConfig, prepare

    path, _ = tiny
    with pytest.raises(ContractError, match="include 8 = L"):
        prepare(PrepareConfig(out=str(tmp_path / "p"), target=str(path), data=str(tmp_path / "none.jsonl"),
                              aux_boundaries=[2, 4, 8]), progress=False)


def test_train_refuses_a_lower_layer_capture(greedy, tiny, tmp_path):
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    path, target = tiny
    common = dict(target=str(path), max_steps=1, batch_tokens=64, val_sequences=1, draft_vocab_size=64, ttt_steps=1,
                  eval_interval=1, save_interval=1, device="cpu")
    with pytest.raises(LabelCheckError, match=r"train --data .*lower.*argmax agrees .* at 0\.\d+"):
        train(TrainConfig(out=str(tmp_path / "d1"), data=str(greedy["lower"].data_dir), **common), target=target,
              progress=False)
    assert train(TrainConfig(out=str(tmp_path / "d2"), data=str(greedy["honest"].data_dir), **common), target=target,
                 progress=False).steps == 1
    with pytest.raises(LabelCheckError):  # the head alone: the greedy rule from the manifest
        train(TrainConfig(out=str(tmp_path / "d3"), data=str(greedy["lower"].data_dir), head_only=True, **common),
              progress=False)


def test_doctor_stored_fails_a_lower_layer_capture_with_the_fix(greedy, tiny, tmp_path):
    from eaglewire.doctor import DoctorConfig, run_doctor
    from eaglewire.model.checkpoint import save_draft
    from eaglewire.model.draft import DraftConfig, Eagle3Draft

    path, target = tiny
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(AUX), draft_vocab_size=256,
                                                vocab_size=256))
    save_draft(tmp_path / "draft", draft, greedy["honest"].contract)
    checks = {}
    for name in ("honest", "lower"):
        report = run_doctor(DoctorConfig(draft=str(tmp_path / "draft"), target=str(path), stored=True,
                                         data=str(greedy[name].data_dir), include_training=True, min_tokens=10))
        checks[name] = next(c for c in report.checks if c.name == "label check")
    assert checks["honest"].verdict == "ok", checks["honest"]
    assert checks["lower"].verdict == "fail" and "boundary 8" in checks["lower"].fix
    assert "argmax agrees" in checks["lower"].evidence[0]


def test_prepare_refuses_a_capture_of_the_wrong_layer(target_dir, tmp_path, monkeypatch):
    """prepare checks what it wrote: a capture whose last state is a lower layer stops it."""
    from eaglewire.data import prepare as prepare_module
    from eaglewire.model.boundary_capture import Capture, capture_packed, token_index

    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hello {i} there"},
                                                     {"role": "assistant", "content": "fine thanks"}]}) + "\n"
                            for i in range(6)))
    config = dict(target=str(target_dir), data=str(rows), max_length=64, regenerate=True, max_new_tokens=12,
                  batch_tokens=512)
    prepare_module.prepare(prepare_module.PrepareConfig(out=str(tmp_path / "ok"), **config), progress=False)

    def lower(target, ids, lengths, contract):
        got = capture_packed(target, ids, lengths, contract)
        with record_boundaries(target, [target.num_layers - 2]) as seen:
            target.decoder(input_ids=ids)
        lower_states = seen[target.num_layers - 2].flatten(0, 1)[token_index(lengths, ids.shape[1])]  # [N, H]
        return Capture(aux_hidden=got.aux_hidden, last_hidden=lower_states)

    monkeypatch.setattr(prepare_module, "capture_packed", lower)
    with pytest.raises(LabelCheckError, match=r"prepare --out .*bad.*argmax agrees"):
        prepare_module.prepare(prepare_module.PrepareConfig(out=str(tmp_path / "bad"), **config), progress=False)


# ------------------------------------------------------------------ the real target (calibration separates)

REAL_STORED = [2, 15, 30]  # what the import is told: aux 2, 15, then boundary L = 30


@pytest.fixture(scope="module")
def real_captures(smollm2_target, tmp_path_factory):
    """vLLM-layout captures of SmolLM2's own greedy replies: honest ([2, 15, 30]) and with the last state
    taken two layers below ([2, 15, 28]), both to be imported as --boundaries 2,15,30."""
    target, tok = smollm2_target, smollm2_target.tokenizer
    root = tmp_path_factory.mktemp("real")
    prompts = ["What is the capital of France?", "Write a haiku about rain.", "How do I sort a list in Python?",
               "Name three colours."]
    rows, dirs = [], {name: root / name for name in ("honest", "lower")}
    for d in dirs.values():
        d.mkdir()
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]  # [1, P]
        with torch.no_grad():
            full = target.model.generate(ids, max_new_tokens=32, do_sample=False)[0]  # [T]
        s = states(target, full, [2, 15, 28, 30])
        for name, last in (("honest", 30), ("lower", 28)):
            save_file({"hidden_states": torch.stack([s[2], s[15], s[last]], dim=1).contiguous(),  # [T, 3, H]
                       "token_ids": full}, str(dirs[name] / f"r{i}.safetensors"))
        rows.append({"id": f"r{i}", "input_ids": full.tolist(),
                     "loss_mask": [0] * ids.shape[1] + [1] * (len(full) - ids.shape[1])})
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dirs, root / "rows.jsonl"


def test_import_refuses_a_shifted_last_state_and_keeps_the_partial(real_captures, tmp_path):
    from eaglewire.model.target import resolve_target_path

    dirs, rows = real_captures
    # identify_boundaries no: the label check's own refusal (the identification refuses this capture first,
    # naming slot 2 as boundary 28: tests/test_import_boundaries.py)
    common = dict(layout="vllm", target=str(resolve_target_path("smollm2-135m")), boundaries=REAL_STORED,
                  tokens=str(rows), identify_boundaries="no")
    summary = import_data(ImportDataConfig(src=str(dirs["honest"]), out=str(tmp_path / "honest"), **common))
    assert (tmp_path / "honest").is_dir() and summary.sequences == 4
    with pytest.raises(LabelCheckError) as e:
        import_data(ImportDataConfig(src=str(dirs["lower"]), out=str(tmp_path / "lower"), **common))
    text = str(e.value) + " ".join(e.value.__notes__)
    assert "import-data --boundaries 2,15,30" in text and "cross-entropy - entropy" in text
    assert not (tmp_path / "lower").exists() and (tmp_path / "lower.partial").is_dir()
    assert "kept in" in text and str(tmp_path / "lower.partial") in text
    honest, lower = (check_labels(ShardDataset(p), load_target_head_cached(), reference=False)
                     for p in (tmp_path / "honest", tmp_path / "lower.partial"))
    assert honest.stored.agreement > lower.stored.agreement + 0.2  # the figures the refusal rests on
    # deleted, the same command with --skip-label-check imports it as it is
    import shutil

    shutil.rmtree(tmp_path / "lower.partial")
    import_data(ImportDataConfig(src=str(dirs["lower"]), out=str(tmp_path / "lower"), skip_label_check=True, **common))
    assert (tmp_path / "lower").is_dir() and not (tmp_path / "lower.partial").exists()


def load_target_head_cached():
    from eaglewire.model.target_head import load_target_head

    return load_target_head("smollm2-135m")


@pytest.mark.parametrize("last,verdict", [(L, "ok"), (L - 2, "fail")])
def test_topk_labels_are_checked_like_the_state_they_came_from(tiny, tmp_path, last, verdict):
    """--labels topk:K stores the head's top K instead of the state: a lower-layer state gives a wrong
    top-1 there too, and the check reads it from the stored labels (no head applied at check time)."""
    _, target = tiny
    seqs = greedy_sequences(target, 6)
    contract = HiddenStateContract(aux_boundaries=AUX, target=target.fingerprint)
    with ShardWriter(tmp_path / "topk", contract, source=GREEDY_SOURCE, labels="topk:8",
                     labels_head=lambda h: target.head(h.to(target.dtype))) as w:
        for i, (ids, mask) in enumerate(seqs):
            s = states(target, ids, [*AUX, last])
            w.add(f"s{i}", ids, mask, torch.cat([s[b] for b in AUX], dim=-1), s[last])
    ds = ShardDataset(tmp_path / "topk")
    assert ds.labels_mode == "topk"
    check = check_labels(ds, target, reference=False)
    assert check.rule == "greedy" and check.verdict == verdict, check.message
