"""Stored states identified by boundary (issue 53): a capture imported one layer off is refused by import-data,
and FAILed by the full doctor on shards imported so, each naming the slots and a re-import line that, run as
printed, imports them right; doctor --stored, which never runs the target, says how to run the identification."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglewire.cli import main
from eaglewire.data.engine_capture import states_here
from eaglewire.data.import_data import BoundaryMismatchError, ImportDataConfig, import_data
from eaglewire.data.shards import ShardDataset
from eaglewire.doctor import DoctorConfig, run_doctor
from eaglewire.model.target import load_target
from tiny import save_random_draft, save_tiny_dir

L, H = 8, 64
TRUE = [2, 4, 6]  # what the capture holds: SpecForge ids 1, 3, 5 (outputs of layers 1, 3, 5)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_dir(tmp_path_factory.mktemp("target"), num_layers=L, hidden_size=H)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def captured(target) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
    """Six sequences of random tokens with every boundary of the target, as a capture tool would see them."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        ids = torch.randint(0, 256, (12 + 2 * i,), generator=g)
        out.append((ids, states_here(target, ids.tolist())))
    return out


@pytest.fixture(scope="module")
def specforge_src(tmp_path_factory, captured, target) -> Path:
    """SpecForge's files: aux_hidden_state [1, T, 3H] of boundaries TRUE (bf16), the post-norm last state."""
    src = tmp_path_factory.mktemp("specforge")
    (src / "rows_0-6").mkdir()
    for i, (ids, every) in enumerate(captured):
        aux = torch.cat([every[b] for b in TRUE], dim=-1).bfloat16()  # [T, 3H]
        with torch.no_grad():
            post = target.decoder.norm(every[L])  # [T, H] after the final norm
        torch.save({"input_ids": ids[None], "loss_mask": torch.ones(1, len(ids), dtype=torch.long),
                    "hidden_state": post[None].bfloat16(), "aux_hidden_state": aux[None]},
                   src / "rows_0-6" / f"data_{i}.ckpt")
    return src


def write_capture(src: Path, captured, boundaries: list[int], layout: str = "vllm") -> dict:
    """The states of ``boundaries`` as ``layout`` stores them (vLLM: hidden_states [T, n, H] and token_ids per
    request; speculators: hidden_states per row, rows in a jsonl); the import's settings for it."""
    src.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (ids, every) in enumerate(captured):
        states = torch.stack([every[b] for b in boundaries], dim=1).bfloat16()  # [T, n, H]
        if layout == "vllm":
            save_file({"hidden_states": states, "token_ids": ids}, str(src / f"req-{i}.safetensors"))
        else:
            save_file({"hidden_states": states}, str(src / f"hs_{i}.safetensors"))
            rows.append(json.dumps({"input_ids": ids.tolist(), "loss_mask": [1] * len(ids)}))
    if layout == "vllm":
        return {"layout": layout}
    (src.parent / f"{src.name}-rows.jsonl").write_text("\n".join(rows) + "\n")
    return {"layout": layout, "tokens": str(src.parent / f"{src.name}-rows.jsonl")}


@pytest.fixture(scope="module")
def vllm_src(tmp_path_factory, captured) -> Path:
    """vLLM's files: hidden_states [T, 4, H] of boundaries TRUE + [L], token_ids."""
    src = tmp_path_factory.mktemp("vllm")
    write_capture(src, captured, [*TRUE, L])
    return src


def config(src, out, target_dir, boundaries, layout="specforge", **kw) -> ImportDataConfig:
    # a random tiny target models no text: its label check cannot judge (tests/data/test_label_check.py)
    return ImportDataConfig(src=str(src), layout=layout, out=str(out), target=str(target_dir),
                            boundaries=boundaries, skip_label_check=True, **kw)


def run_line(line: str) -> int:
    words = shlex.split(line)
    assert words[:2] == ["eaglewire", "import-data"]
    return main(words[1:])


@pytest.mark.parametrize("said, why", [([1, 3, 5], "one layer above what was said"),
                                       ([3, 5, 7], "one layer below what was said")])
def test_a_specforge_import_one_off_is_refused_with_the_line_that_fixes_it(specforge_src, target_dir, tmp_path,
                                                                          said, why):
    """ids read one too low (SpecForge's layer-output ids passed as boundaries) and one too high: refused before
    anything is written, each slot named with the boundary it is; the printed line imports them right."""
    out = tmp_path / "out"
    with pytest.raises(BoundaryMismatchError) as e:
        import_data(config(specforge_src, out, target_dir, said))
    message = str(e.value)
    for j, (s, t) in enumerate(zip(said, TRUE)):
        assert f"slot {j} (--boundaries says boundary {s}) is boundary {t}" in message
    assert why in message and "Nothing was imported" in message
    assert not out.exists() and not Path(str(out) + ".partial").exists()
    line = e.value.command
    assert line in message and "--boundaries 2,4,6" in line and "--from specforge" in line
    assert run_line(line) == 0
    back = ShardDataset(out)
    assert list(back.contract.aux_boundaries) == TRUE and len(back) == 6


def test_the_right_boundaries_are_confirmed(specforge_src, target_dir, tmp_path):
    summary = import_data(config(specforge_src, tmp_path / "out", target_dir, TRUE))
    assert any(n.startswith("each stored state is the boundary --boundaries names") for n in summary.notes)
    source = ShardDataset(tmp_path / "out").manifest["source"]
    assert source["import_config"]["boundaries"] == TRUE  # the doctor rebuilds the import line from it


def test_a_vllm_import_one_off_names_the_slots_and_keeps_the_right_one(vllm_src, target_dir, tmp_path):
    """vLLM ids are boundaries already; taken as layer outputs (+1) the aux slots are one too high, boundary L
    (its own slot) is right and not named."""
    with pytest.raises(BoundaryMismatchError) as e:
        import_data(config(vllm_src, tmp_path / "out", target_dir, [3, 5, 7, L], layout="vllm"))
    message = str(e.value)
    assert "slot 2 (--boundaries says boundary 7) is boundary 6" in message and "slot 3" not in message
    assert "--boundaries 2,4,6,8" in e.value.command
    assert run_line(e.value.command) == 0
    assert list(ShardDataset(tmp_path / "out").contract.aux_boundaries) == TRUE


def test_a_large_target_is_not_loaded_unasked(specforge_src, target_dir, tmp_path, monkeypatch):
    import eaglewire.data.import_data as module

    monkeypatch.setattr(module, "IDENTIFY_MAX_BYTES", 0)
    summary = import_data(config(specforge_src, tmp_path / "out", target_dir, [1, 3, 5]))
    note = next(n for n in summary.notes if n.startswith("boundaries not identified"))
    assert "--identify-boundaries yes" in note and "eaglewire doctor" in note
    with pytest.raises(BoundaryMismatchError):  # asked: loaded whatever its size
        import_data(config(specforge_src, tmp_path / "out2", target_dir, [1, 3, 5], identify_boundaries="yes"))


# ------------------------------------------------------------------ the doctor on shards imported one off

@pytest.fixture(scope="module")
def misimported(tmp_path_factory, specforge_src, target_dir, target) -> Path:
    """Shards imported as [1, 3, 5] (as before the identification: --identify-boundaries no), and two random drafts:
    one declaring what the shards record, one declaring what they hold."""
    root = tmp_path_factory.mktemp("misimported")
    import_data(config(specforge_src, root / "data", target_dir, [1, 3, 5], identify_boundaries="no"))
    save_random_draft(root / "draft", target, aux_boundaries=(1, 3, 5))
    save_random_draft(root / "other", target, aux_boundaries=tuple(TRUE))
    return root


def doctor_config(root, target_dir, draft="draft", **kw) -> DoctorConfig:
    return DoctorConfig(**{"draft": str(root / draft), "target": str(target_dir), "data": str(root / "data"),
                           "include_training": True, "engine_prompts": 0, "min_tokens": 1, "tune": False,
                           "skip_label_check": True, **kw})


def test_the_full_doctor_names_the_misread_slots_and_the_reimport(misimported, target_dir, target):
    report = run_doctor(doctor_config(misimported, target_dir), target=target)
    check = next(c for c in report.checks if c.name == "stored boundaries")
    assert check.verdict == "fail" and "[1, 3, 5] are [2, 4, 6]" in check.summary
    assert any("slot 0 (recorded as boundary 1) is boundary 2" in e for e in check.evidence)
    line = check.fix.split("`")[1]
    assert "--boundaries 2,4,6" in line and str(misimported / "data-reimported") in line
    drift = next(c for c in report.checks if c.name == "capture drift")
    assert drift.verdict == "fail" and "precision" not in drift.fix and line in drift.fix
    # applied, it passes: the re-import is confirmed, and the full doctor on it finds every state its own
    assert "--identify-boundaries" not in line  # the re-import is identified again
    assert run_line(line + " --skip-label-check") == 0  # (not recorded: the random target only)
    again = run_doctor(doctor_config(misimported, target_dir, draft="other",
                                     data=str(misimported / "data-reimported")), target=target)
    assert next(c for c in again.checks if c.name == "stored boundaries").verdict == "ok"
    assert next(c for c in again.checks if c.name == "capture drift").verdict == "ok"


def test_the_stored_doctor_says_how_to_identify(misimported, target_dir):
    report = run_doctor(doctor_config(misimported, target_dir, stored=True))
    check = next(c for c in report.checks if c.name == "stored boundaries")
    assert check.verdict == "skip" and "needs the target to run" in check.summary
    line = check.fix.split("`")[1]
    assert line.startswith(f"eaglewire doctor --draft {misimported / 'draft'}") and "--stored" not in line


def test_the_stored_doctor_with_a_draft_of_the_true_layers_names_the_cheap_fix(misimported, target_dir):
    """Another draft (trained on [2, 4, 6]) on the shards recorded [1, 3, 5]: not 'import every stored state'
    (there is none more), but the identification and the re-import line it would confirm."""
    report = run_doctor(doctor_config(misimported, target_dir, draft="other", stored=True))
    check = next(c for c in report.checks if c.name == "accuracy in isolation")
    assert check.verdict == "fail" and "one layer below the draft's" in check.fix
    assert "eaglewire doctor --draft" in check.fix and "--boundaries 2,4,6" in check.fix


def test_a_last_slot_from_another_layer_is_named_and_no_line_is_offered(captured, target_dir, tmp_path):
    """A vLLM capture whose boundary-L slot is boundary 6: the slot is named, and since no stored state is
    boundary L, no import line would work: the refusal says why instead of printing one."""
    src = tmp_path / "src"
    write_capture(src, captured, [2, 4, 5, 6])
    with pytest.raises(BoundaryMismatchError) as e:
        import_data(config(src, tmp_path / "out", target_dir, [2, 4, 5, L], layout="vllm"))
    message = str(e.value)
    assert f"slot 3 (--boundaries says boundary {L}) is boundary 6" in message and "slot 0" not in message
    assert e.value.command is None and f"none is boundary {L}" in message


@pytest.mark.parametrize("layout, no_last", [("speculators", False), ("vllm", False), ("vllm", True)])
def test_a_last_state_said_one_below_is_named_with_the_line_that_takes_it_as_L(captured, target_dir, tmp_path,
                                                                               layout, no_last):
    """Boundary L said to be L - 1 (the last layer's index): not "none is boundary L ... pass --no-last", but the
    slot named as boundary L and the import line with L, which imports it as the training signal (--no-last
    dropped: a stored state is boundary L)."""
    src = tmp_path / "src"
    settings = write_capture(src, captured, [*TRUE, L], layout)
    with pytest.raises(BoundaryMismatchError) as e:
        import_data(config(src, tmp_path / "out", target_dir, [*TRUE, L - 1], no_last=no_last, **settings))
    message = str(e.value)
    assert f"slot 3 (--boundaries says boundary {L - 1}) is boundary {L}" in message and "slot 0" not in message
    assert f"the last layer's index ({L - 1}, counting from 0)" in message and "SpecForge" not in message
    line = e.value.command
    assert line in message and f"--boundaries 2,4,6,{L}" in line and "--no-last" not in line
    assert run_line(line) == 0
    back = ShardDataset(tmp_path / "out")
    assert list(back.contract.aux_boundaries) == TRUE
    assert back.manifest["source"]["last_hidden"] == f"stored boundary {L}"


@pytest.mark.real
def test_smollm2_specforge_ids_taken_as_boundaries_are_named(smollm2_target, tmp_path):
    """The issue's case on the real target: SpecForge ids 2, 15, 27 (outputs of layers 2, 15, 27: boundaries 3, 16,
    28), stored in bf16, imported as boundaries 2, 15, 27. Per token, each slot is its own boundary within bf16's
    rounding and a layer away from the one it was said to be, attention sink at token 0 and all."""
    from eaglewire.model.target import resolve_target_path

    target, tok = smollm2_target, smollm2_target.tokenizer
    src = tmp_path / "src" / "rows_0-2"
    src.mkdir(parents=True)
    for i, p in enumerate(["What is the capital of France? Answer in one sentence.", "Write a haiku about rain."]):
        ids = tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": "Sure."}],
                                      return_tensors="pt", return_dict=True)["input_ids"][0]  # [T]
        every = states_here(target, ids.tolist())
        with torch.no_grad():
            post = target.decoder.norm(every[30])  # [T, H]
        torch.save({"input_ids": ids[None], "loss_mask": torch.ones(1, len(ids), dtype=torch.long),
                    "hidden_state": post[None].bfloat16(),
                    "aux_hidden_state": torch.cat([every[b] for b in (3, 16, 28)], dim=-1)[None].bfloat16()},
                   src / f"data_{i}.ckpt")
    with pytest.raises(BoundaryMismatchError) as e:
        import_data(ImportDataConfig(src=str(tmp_path / "src"), layout="specforge", out=str(tmp_path / "out"),
                                     target=str(resolve_target_path("smollm2-135m")), boundaries=[2, 15, 27]))
    found = e.value.identification
    assert [c.closest for c in found.checks] == [3, 16, 28]
    assert all(c.closest_error < 0.02 and c.own > 0.2 for c in found.checks)  # bf16 rounding vs a layer away
    assert "--boundaries 3,16,28" in e.value.command


def test_the_stored_doctor_names_the_import_that_stores_the_drafts_boundaries(vllm_src, target, target_dir,
                                                                             tmp_path):
    """The draft reads [2, 4, 6]; the data were imported with only [2, 4] as aux of the stored [2, 4, 6, 8]: the
    fix is the import line that stores 6 too, runnable as printed."""
    import_data(config(vllm_src, tmp_path / "data", target_dir, [*TRUE, L], layout="vllm", aux_boundaries=[2, 4]))
    save_random_draft(tmp_path / "draft", target, aux_boundaries=tuple(TRUE))
    report = run_doctor(doctor_config(tmp_path, target_dir, stored=True))
    check = next(c for c in report.checks if c.name == "accuracy in isolation")
    assert check.verdict == "fail" and "the import stored them" in check.fix
    line = check.fix.split("`")[1]
    assert "--aux-boundaries 2,4,6" in line and "--boundaries 2,4,6,8" in line
    assert run_line(line + " --skip-label-check") == 0
    assert list(ShardDataset(tmp_path / "data-reimported").contract.aux_boundaries) == TRUE
