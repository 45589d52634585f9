"""Every field llama.cpp reads from a draft GGUF (engines/llamacpp/served.py), on GGUFs written by llama.cpp's
own converter and rewritten by its gguf-py: the GGUF's own token_embd (another model's rows) and
eagle3.norm_before_fc with its norm tensor used to pass the doctor; now each FAILs, is measured as llama.cpp
computes it, and the printed fix, applied, passes."""

from __future__ import annotations

import json
import re
import shlex

import numpy as np
import pytest
import torch

from eaglewire.doctor.engine_reading import read_file_fields as read_gguf_fields
from eaglewire.engines import llamacpp as engine
from eaglewire.engines.llamacpp.served import NORM_BEFORE_FC_TENSOR, REEXPORT_FIX, read_served
from gguf_edit import rewrite_gguf

BOUNDARIES = (2, 4, 5)
CHATS = ["Name three primary colors.", "What is the capital of France?", "Write a haiku about rain.",
         "Give me two tips for better sleep.", "What does a CPU do?", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, target_dir, chat_tiny_target):
    """A random tiny draft recording the tiny target's directory, exported through llama.cpp's converter."""
    if engine.find_tree() is None:
        pytest.skip(f"llama.cpp source tree not installed ({engine.INSTALL_HINT})")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (eaglewire[llamacpp])")
    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.engines import export_draft
    from eaglewire.model.checkpoint import save_draft
    from eaglewire.model.draft import DraftConfig, Eagle3Draft

    root = tmp_path_factory.mktemp("llamacpp-fields")
    V = chat_tiny_target.vocab_size
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(chat_tiny_target.text_config, num_aux=3, draft_vocab_size=V,
                                                vocab_size=V))
    native = save_draft(root / "draft", draft, HiddenStateContract(aux_boundaries=BOUNDARIES,
                                                                   target=chat_tiny_target.fingerprint),
                        {"target": str(target_dir)})
    export_draft(native, "llamacpp", root / "out", outtype="f32", target_outtype="none", target=chat_tiny_target)
    return root, native, root / "out" / "draft-f32.gguf"


def _rows(target):
    ids = torch.arange(0, target.vocab_size, 97)  # [N] a spread of token ids
    return ids, target.embed_tokens.weight.detach()[ids].float()  # [N], [N, H]


NORM_WEIGHT = 2.0  # the GGUF's own enc.output_norm weight, every channel


@pytest.fixture(scope="module")
def faults(exported):
    """The export rewritten with each fault (gguf-py parses a GGUF with SmolLM2's vocabulary in seconds, so once)."""
    root, _, gguf = exported
    rows = read_served(gguf).own_embedding.numpy()  # [V, H]
    permuted = rows[np.random.default_rng(0).permutation(rows.shape[0])]  # [V, H] another model's rows
    width = 3 * read_served(gguf).served.target_hidden_size
    norm = {NORM_BEFORE_FC_TENSOR: np.full(width, NORM_WEIGHT, np.float32)}  # [3*Ht]
    return {
        "token_embd": rewrite_gguf(gguf, root / "perm.gguf", tensors={"token_embd.weight": permuted}),
        "norm_before_fc": rewrite_gguf(gguf, root / "nbf.gguf", fields={"eagle3.norm_before_fc": True}, tensors=norm),
        "norm_before_fc without its tensor": rewrite_gguf(gguf, root / "bare.gguf",
                                                          fields={"eagle3.norm_before_fc": True}),
        "output": rewrite_gguf(gguf, root / "head.gguf", tensors={"output.weight": 0.5 * read_served(gguf).own_head.numpy()}),
        "both": rewrite_gguf(gguf, root / "both.gguf", fields={"eagle3.norm_before_fc": True},
                             tensors={**norm, "token_embd.weight": permuted}),
    }


@pytest.fixture(scope="module")
def trained(exported):
    from eaglewire.model.checkpoint import load_draft

    return load_draft(exported[1])[0]


def test_an_honest_export_reads_as_trained(exported, trained, chat_tiny_target):
    reading = read_gguf_fields(exported[2], trained, emb_rows=_rows(chat_tiny_target))
    assert reading.found == [], [m.meaning for m in reading.found]
    assert reading.served.embedding == "target"  # its token_embd holds the target's rows
    assert np.float32(reading.served.rms_norm_eps) == np.float32(trained.config.rms_norm_eps)


def test_another_models_token_embd_is_read_and_measurable(faults, trained, chat_tiny_target):
    reading = read_gguf_fields(faults["token_embd"], trained, emb_rows=_rows(chat_tiny_target))
    [found] = reading.found
    assert found.field == "embed_tokens" and found.measurable and found.fix == REEXPORT_FIX
    assert torch.equal(reading.embedding, read_served(faults["token_embd"]).own_embedding)


def test_norm_before_fc_is_read_with_its_tensor_or_refused_without(faults, trained, chat_tiny_target):
    reading = read_gguf_fields(faults["norm_before_fc"], trained, emb_rows=_rows(chat_tiny_target))
    [found] = reading.found
    assert found.field == "norm_before_fc" and found.measurable
    assert torch.equal(reading.norm_weights["norm_before_fc"],
                       torch.full((3 * chat_tiny_target.hidden_size,), NORM_WEIGHT))
    [found] = read_gguf_fields(faults["norm_before_fc without its tensor"], trained,
                               emb_rows=_rows(chat_tiny_target)).found
    assert not found.measurable and "refuses to load" in found.meaning


def test_output_rows_that_are_not_the_trained_head_are_read_and_measurable(faults, trained, chat_tiny_target):
    reading = read_gguf_fields(faults["output"], trained, emb_rows=_rows(chat_tiny_target))
    [found] = reading.found
    assert found.field == "lm_head" and found.measurable and "output.weight" in found.meaning
    assert torch.allclose(reading.lm_head, 0.5 * trained.lm_head.weight.detach())  # as written, in float32


def test_the_served_norm_weight_is_the_one_applied(faults, trained):
    """as_served puts the GGUF's own enc.output_norm weight in front of fc (not ones)."""
    from eaglewire.engines.serving.served_draft import as_served

    reading = read_gguf_fields(faults["norm_before_fc"], trained)
    built = as_served(trained, reading.found, norm_weights=reading.norm_weights)
    width = 3 * trained.config.target_hidden_size
    aux = torch.randn(1, 5, width)  # [B, T, 3*Ht]
    normed = aux * torch.rsqrt(aux.pow(2).mean(-1, keepdim=True) + trained.config.rms_norm_eps)  # [B, T, 3*Ht]
    # the same matmul over differently rounded inputs: float32 tolerance
    assert torch.allclose(built.fuse(aux), trained.fc(NORM_WEIGHT * normed), atol=1e-5)


def _chats(tmp_path) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": f"Here is my answer to: {p} " * 3}]}) + "\n"
        for i, p in enumerate(CHATS)))
    return str(path)


def _doctor(target, draft, chats, gguf):
    from eaglewire.doctor import run_doctor
    from eaglewire.doctor.doctor_config import DoctorConfig

    report = run_doctor(DoctorConfig(draft=str(draft), conversations=chats, engine="llamacpp",
                                     engine_config=str(gguf), engine_prompts=0, tune=False, include_training=True,
                                     min_tokens=1), target=target)
    return {c.name: c for c in report.checks}, report


def _apply(fix: str, draft, out) -> str:
    """The command the fix prints, run as printed with DRAFT and DIR filled in; the GGUF it wrote."""
    from eaglewire.cli import main

    command = re.search(r"`(eaglewire export [^`]+)`", fix).group(1)
    argv = shlex.split(command.replace("DRAFT", str(draft)).replace("DIR", str(out)))[1:]
    assert main(argv + ["--outtype", "f32", "--target-outtype", "none"]) == 0
    return next(out.glob("draft-*.gguf"))


def test_the_doctor_fails_the_gguf_faults_measured_and_the_fix_applied_passes(exported, faults, chat_tiny_target,
                                                                             tmp_path):
    """Both faults in one GGUF (each alone is read above): one FAIL naming both, measured as llama.cpp computes
    the draft; the printed re-export, run as printed, passes."""
    _, native, _ = exported
    chats = _chats(tmp_path)
    checks, report = _doctor(chat_tiny_target, native, chats, faults["both"])
    fields = checks["engine fields"]
    assert fields.verdict == "fail" and report.exit_code == 1, fields
    assert "embed_tokens" in fields.summary and "norm_before_fc" in fields.summary
    assert "acc@0 as served" in report.accuracy  # measured as llama.cpp computes it
    fixed = _apply(fields.fix, native, tmp_path / "fixed")
    checks, _ = _doctor(chat_tiny_target, native, chats, fixed)
    assert checks["engine fields"].verdict == "ok", checks["engine fields"]
    assert checks["engine wiring"].verdict == "ok"
