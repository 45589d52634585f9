"""The label state named for what it is: a failed label check tells another layer from boundary L on the
other side of the final norm, and names the fix that works (import-data --last-state, or --boundaries).

The target is a tiny random Llama whose final norm weight is far from ones (|w| in [0.5, 3], a fifth of
them negative; at ones the two sides of an RMS norm read alike) and whose lm_head is scaled by 3 (a
confident head), on its own greedy replies: the head's calibration, the rule import-data judges by,
then separates the readings (cross-entropy - entropy: the honest state -0.31 nats, the post-norm one
read as pre-norm +17.6, the state two layers below +2.9).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglewire.cli import main
from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.foreign import ForeignDataError
from eaglewire.data.import_data import ImportDataConfig, import_data
from eaglewire.data.label_check import (CALIBRATION_MAX_GAP, OTHER_LAYER, POST_NORM, PRE_NORM, LabelCheckError,
                                        check_labels, stored_last_state)
from eaglewire.data.shards import ShardDataset, ShardWriter
from eaglewire.model.boundary_capture import record_boundaries
from eaglewire.model.target import load_target
from eaglewire.model.target_head import load_target_head
from tiny import save_tiny_dir

L, AUX = 8, (2, 4, 5)
LOWER = L - 2  # another layer's state
PROMPT, NEW, SEQUENCES = 6, 24, 6
HEAD_SCALE = 3.0  # lm_head x 3: a confident head
NORM_MAGNITUDE = (0.5, 3.0)  # |final norm weight|; NEGATIVE_SHARE of the channels negative
NEGATIVE_SHARE = 0.2
NEAR_ZERO_RANGE = (-1.0, 3.0)  # a final norm weight with channels near 0: a state divided by it reads flat
GREEDY_SOURCE = {"regenerated": True, "regenerate": {"max_new_tokens": NEW, "temperature": 0.0}}
BOUNDARIES_FIX = "--boundaries whose last value names"


def save_target(path: Path, norm_weight) -> Path:
    """The tiny target with its final norm weight set by ``norm_weight(H, generator)`` [H] and a confident
    head, saved as a --target."""
    save_tiny_dir(path, num_layers=L)
    target = load_target(str(path), device="cpu", dtype="fp32")
    with torch.no_grad():
        target.decoder.norm.weight.copy_(norm_weight(target.hidden_size, torch.Generator().manual_seed(1)))
        target.model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    target.model.save_pretrained(path)
    return path


def far_from_zero(H: int, g: torch.Generator) -> torch.Tensor:
    magnitude = torch.empty(H).uniform_(*NORM_MAGNITUDE, generator=g)  # [H]
    return magnitude * torch.where(torch.rand(H, generator=g) < NEGATIVE_SHARE, -1.0, 1.0)  # [H]


def near_zero(H: int, g: torch.Generator) -> torch.Tensor:
    return torch.empty(H).uniform_(*NEAR_ZERO_RANGE, generator=g)  # [H] some channels ~0


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("target"), far_from_zero)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def head(target_dir):
    return load_target_head(str(target_dir))


@pytest.fixture(scope="module")
def captured(target):
    return capture_greedy(target)


def capture_greedy(target) -> list[dict]:
    """Per sequence: input_ids [T], loss_mask [T] and the states {2, 4, 5, LOWER, L, "post": norm(L)} [T, H],
    on the target's own greedy replies to random prompts."""
    g = torch.Generator().manual_seed(0)
    out = []
    with torch.no_grad():
        for _ in range(SEQUENCES):
            ids = torch.randint(0, target.vocab_size, (1, PROMPT), generator=g)  # [1, PROMPT]
            for _ in range(NEW):
                nxt = target.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
                ids = torch.cat([ids, nxt], dim=1)
            with record_boundaries(target, [*AUX, LOWER, L]) as seen:
                target.decoder(input_ids=ids)
            states = {b: seen[b][0] for b in (*AUX, LOWER, L)}  # [T, H] each
            states["post"] = target.decoder.norm(states[L])  # [T, H] HF's hidden_states[-1]
            out.append({"input_ids": ids[0], "loss_mask": (torch.arange(ids.shape[1]) >= PROMPT).long(),
                        "states": states})
    return out


def write_vllm(captured, root: Path, last) -> tuple[Path, Path]:
    """vLLM connector files whose stored states are AUX then ``last`` ([T, 4, H]), and the rows (loss masks)."""
    src = root / f"vllm-{last}"
    src.mkdir()
    rows = []
    for i, c in enumerate(captured):
        stacked = torch.stack([c["states"][b] for b in (*AUX, last)], dim=1).contiguous()  # [T, 4, H]
        save_file({"hidden_states": stacked, "token_ids": c["input_ids"]}, str(src / f"r{i}.safetensors"))
        rows.append({"id": f"r{i}", "input_ids": c["input_ids"].tolist(), "loss_mask": c["loss_mask"].tolist()})
    tokens = root / f"vllm-{last}-rows.jsonl"
    tokens.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src, tokens


def write_specforge(captured, root: Path, last) -> Path:
    """SpecForge feature files: aux_hidden_state [1, T, k*H] and ``last`` as its hidden_state [1, T, H]."""
    src = root / f"specforge-{last}"
    (src / "rows_0-2000").mkdir(parents=True)
    for i, c in enumerate(captured):
        aux = torch.cat([c["states"][b] for b in AUX], dim=-1)  # [T, k*H]
        torch.save({"input_ids": c["input_ids"][None], "loss_mask": c["loss_mask"][None],
                    "hidden_state": c["states"][last][None], "aux_hidden_state": aux[None]},
                   src / "rows_0-2000" / f"data_{i}.ckpt")
    return src


@pytest.fixture(scope="module")
def sources(captured, tmp_path_factory):
    root = tmp_path_factory.mktemp("captures")
    return {"vllm": {last: write_vllm(captured, root, last) for last in (L, "post", LOWER)},
            "specforge": {last: write_specforge(captured, root, last) for last in (L, "post")}}


def run_import(sources, layout: str, last, out: Path, target_dir: Path, **kw):
    if layout == "vllm":
        src, tokens = sources["vllm"][last]
        kw = {"boundaries": [*AUX, L], "tokens": str(tokens), **kw}
    else:
        src, kw = sources["specforge"][last], {"boundaries": list(AUX), **kw}
    return import_data(ImportDataConfig(src=str(src), layout=layout, out=str(out), target=str(target_dir), **kw))


def refused(sources, layout: str, last, out: Path, target_dir: Path, **kw) -> tuple[LabelCheckError, str]:
    """The import's refusal and its whole text (message and notes)."""
    with pytest.raises(LabelCheckError) as e:
        run_import(sources, layout, last, out, target_dir, **kw)
    assert not out.exists() and out.with_name(out.name + ".partial").is_dir()
    return e.value, str(e.value) + "\n" + "\n".join(e.value.__notes__)


def test_controls_pass_with_the_layouts_default(sources, target_dir, head, tmp_path):
    """vLLM's pre-norm boundary L and SpecForge's post-norm hidden_state import as they are by default."""
    for layout, last, side in (("vllm", L, PRE_NORM), ("specforge", "post", POST_NORM)):
        out = tmp_path / layout
        run_import(sources, layout, last, out, target_dir)
        ds = ShardDataset(out)
        assert ds.manifest["source"]["last_state"] == side == stored_last_state(ds.manifest["source"])
        check = check_labels(ds, head, greedy=False, reference=False)
        assert check.verdict == "ok" and check.diagnosis is None and check.other_reading is None, check.message
        assert check.stored.gap <= CALIBRATION_MAX_GAP


def test_a_post_norm_state_imported_as_pre_norm_names_last_state_post_norm(sources, target_dir, head, tmp_path):
    error, text = refused(sources, "vllm", "post", tmp_path / "bad", target_dir)
    check = error.check
    assert check.verdict == "fail" and check.diagnosis == POST_NORM and check.norm_side_wrong
    assert check.stored.gap > CALIBRATION_MAX_GAP >= check.other_reading.gap  # the other reading is calibrated
    assert check.other_reading.agreement > check.stored.agreement
    assert "AFTER the final norm" in check.message and "The layer is right, the norm is not" in check.message
    assert "`eaglewire import-data ... --last-state post-norm`" in check.message
    assert "import again with --last-state post-norm" in text
    assert BOUNDARIES_FIX not in text and "--skip-label-check" not in text  # neither would fix it
    assert "import-data --boundaries 2,4,5,8 --last-state pre-norm" in text  # what was imported, named
    assert check.to_dict()["diagnosis"] == POST_NORM

    # the fix, applied: the same capture re-imported with --last-state post-norm passes
    shutil.rmtree(tmp_path / "bad.partial")
    summary = run_import(sources, "vllm", "post", tmp_path / "bad", target_dir, last_state=POST_NORM)
    ds = ShardDataset(tmp_path / "bad")
    assert ds.manifest["source"]["last_state"] == POST_NORM and "post-norm" in ds.manifest["source"]["last_hidden"]
    assert any("--last-state post-norm" in n for n in summary.notes)
    fixed = check_labels(ds, head, greedy=False, reference=False)
    assert fixed.verdict == "ok" and fixed.stored.gap <= CALIBRATION_MAX_GAP, fixed.message


def test_a_pre_norm_state_in_a_specforge_capture_names_last_state_pre_norm(sources, target_dir, head, captured,
                                                                          tmp_path):
    error, text = refused(sources, "specforge", L, tmp_path / "bad", target_dir)
    check = error.check
    assert check.diagnosis == PRE_NORM and check.norm_side_wrong
    assert check.stored.gap > CALIBRATION_MAX_GAP >= check.other_reading.gap
    assert "BEFORE the final norm" in check.message and "--last-state pre-norm" in check.message
    assert "import again with --last-state pre-norm" in text and BOUNDARIES_FIX not in text

    shutil.rmtree(tmp_path / "bad.partial")
    summary = run_import(sources, "specforge", L, tmp_path / "bad", target_dir, last_state=PRE_NORM)
    ds = ShardDataset(tmp_path / "bad")
    assert ds.manifest["source"]["last_state"] == PRE_NORM and "post-norm" not in ds.manifest["source"]["last_hidden"]
    assert any("--last-state pre-norm" in n for n in summary.notes)
    assert torch.equal(ds[0]["last_hidden"], captured[0]["states"][L].bfloat16())  # taken as stored
    assert check_labels(ds, head, greedy=False, reference=False).verdict == "ok"


def test_another_layers_state_keeps_the_boundaries_fix(sources, target_dir, tmp_path):
    # the label check's own diagnosis: import-data's boundary identification, which refuses this capture first,
    # is tested in tests/test_import_boundaries.py
    error, text = refused(sources, "vllm", LOWER, tmp_path / "lower", target_dir, identify_boundaries="no")
    check = error.check
    assert check.diagnosis == OTHER_LAYER and not check.norm_side_wrong
    assert check.other_reading.gap > CALIBRATION_MAX_GAP  # neither side of the norm gives the head's labels
    assert "the stored last state is not boundary L = 8" in check.message
    assert "read as the other side of the final norm it fails too" in check.message
    assert f"import again with {BOUNDARIES_FIX} the stored state that is boundary 8" in text
    assert "--last-state" not in "\n".join(error.__notes__)  # the fix in the notes is --boundaries alone
    # --last-state post-norm does not rescue it: still another layer
    error, _ = refused(sources, "vllm", LOWER, tmp_path / "lower2", target_dir, last_state=POST_NORM)
    assert error.check.diagnosis == OTHER_LAYER


def write_shards(out: Path, target, captured, last, *, labels: str = "hidden") -> ShardDataset:
    """eaglewire shards (no import) whose last state is ``last``: what a capture of the wrong side would write."""
    contract = HiddenStateContract(aux_boundaries=AUX, target=target.fingerprint)
    with ShardWriter(out, contract, source=GREEDY_SOURCE, labels=labels,
                     labels_head=lambda h: target.head(h.to(target.dtype))) as w:
        for i, c in enumerate(captured):
            aux = torch.cat([c["states"][b] for b in AUX], dim=-1)  # [T, k*H]
            w.add(f"s{i}", c["input_ids"], c["loss_mask"], aux, c["states"][last])
    return ShardDataset(out)


@pytest.mark.parametrize("rule", ["greedy", "reference"])
def test_every_rule_diagnoses_the_post_norm_state(rule, target, head, captured, tmp_path):
    """The greedy rule (head only) and the target's own rate (full target) diagnose it too; shards that
    eaglewire captured itself are told to capture before the norm, not to re-import."""
    honest, post = (write_shards(tmp_path / str(last), target, captured, last) for last in (L, "post"))
    judge = head if rule == "greedy" else target
    ok, bad = check_labels(honest, judge), check_labels(post, judge)
    assert ok.rule == bad.rule == rule and ok.verdict == "ok" and ok.diagnosis is None, ok.message
    assert bad.verdict == "fail" and bad.diagnosis == POST_NORM, bad.message
    assert "capture boundary L before it" in bad.message and "re-import" not in bad.message


def test_a_flat_other_reading_is_no_diagnosis(tmp_path):
    """A norm weight near 0 makes another layer's state, read as post-norm (/ norm(1)), nearly flat: calibrated
    (a flat head's cross-entropy is its entropy) but no better at agreeing, so it stays another layer."""
    path = save_target(tmp_path / "target", near_zero)
    target = load_target(str(path), device="cpu", dtype="fp32")
    ds = write_shards(tmp_path / "lower", target, capture_greedy(target), LOWER)
    check = check_labels(ds, load_target_head(str(path)), greedy=False, reference=False)
    assert check.verdict == "fail" and check.other_reading.gap <= CALIBRATION_MAX_GAP  # passes the rule alone
    assert check.other_reading.agreement <= check.stored.agreement
    assert check.diagnosis == OTHER_LAYER, check.message


def test_top_k_labels_store_no_state_to_diagnose(target, head, captured, tmp_path):
    ds = write_shards(tmp_path / "topk", target, captured, "post", labels="topk:8")
    check = check_labels(ds, head)
    assert check.verdict == "fail" and check.diagnosis is None and check.other_reading is None
    assert "top-K labels store no state" in check.message and "--last-state" in check.message


def test_train_and_doctor_name_the_re_import(sources, target_dir, target, tmp_path):
    """train takes no --last-state: it names import-data's; doctor --stored's fix is the re-import."""
    from eaglewire.doctor import DoctorConfig, run_doctor
    from eaglewire.model.checkpoint import save_draft
    from eaglewire.model.draft import DraftConfig, Eagle3Draft
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    data = tmp_path / "post"
    run_import(sources, "vllm", "post", data, target_dir, skip_label_check=True)
    with pytest.raises(LabelCheckError, match=r"train --data .*re-import with `eaglewire import-data \.\.\. "
                                              r"--last-state post-norm`") as e:
        train(TrainConfig(out=str(tmp_path / "draft-run"), data=str(data), target=str(target_dir), head_only=True,
                          max_steps=1, batch_tokens=64, val_sequences=1, draft_vocab_size=64, ttt_steps=1,
                          device="cpu"), progress=False)
    assert e.value.check.diagnosis == POST_NORM and BOUNDARIES_FIX not in str(e.value)

    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(AUX), draft_vocab_size=256,
                                                vocab_size=256))
    save_draft(tmp_path / "draft", draft, ShardDataset(data).contract)
    report = run_doctor(DoctorConfig(draft=str(tmp_path / "draft"), target=str(target_dir), stored=True,
                                     data=str(data), include_training=True, min_tokens=10))
    label = next(c for c in report.checks if c.name == "label check")
    assert label.verdict == "fail" and "as the pre-norm state" in label.summary
    assert label.fix.startswith("re-import (eaglewire import-data) with --last-state post-norm")
    assert BOUNDARIES_FIX not in label.fix


def test_the_flag_on_the_command_line_and_its_refusals(sources, target_dir, tmp_path, capsys):
    src, tokens = sources["vllm"]["post"]
    common = ["import-data", "--from", "vllm", str(src), "--target", str(target_dir), "--boundaries", "2,4,5,8",
              "--tokens", str(tokens)]
    assert main([*common, "--out", str(tmp_path / "ok"), "--last-state", "post-norm"]) == 0
    assert ShardDataset(tmp_path / "ok").manifest["source"]["last_state"] == POST_NORM
    with pytest.raises(SystemExit):  # argparse: not a choice
        main([*common, "--out", str(tmp_path / "x"), "--last-state", "after"])
    assert "--last-state" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--no-last"):
        ImportDataConfig(src=str(src), layout="vllm", out=str(tmp_path / "y"), target=str(target_dir),
                         last_state=POST_NORM, no_last=True)
    config_only = tmp_path / "config-only"  # no weights: no final norm to map a post-norm state back through
    config_only.mkdir()
    for f in Path(target_dir).iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, config_only / f.name)
    with pytest.raises(ForeignDataError, match="--last-state post-norm.*must hold the weights"):
        run_import(sources, "vllm", "post", tmp_path / "z", config_only, last_state=POST_NORM)

