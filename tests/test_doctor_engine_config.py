"""The doctor reads every field of an engine's config as that engine reads it (engines/serving/served_draft.py and
each engine's ``read_served``): a field read otherwise than trained FAILs with the key to write, and
the draft as the engine builds it is measured beside the trained one; correct exports pass."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.engine_reading import read_fields
from eaglewire.engines import export_draft
from eaglewire.engines import sglang, vllm
from eaglewire.engines.formats import speculators_layout
from eaglewire.engines.serving.served_draft import as_served, mismatches
from eaglewire.model.checkpoint import load_draft
from test_formats import make_native
from tiny import tiny_target

CHATS = ["Name three primary colors.", "What is the capital of France?", "Write a haiku about rain.",
         "Give me two tips for better sleep.", "What does a CPU do?", "Why is the sky blue?"]


def _edit(directory: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key in drop:
        config.pop(key)
    config.update(changes)
    path.write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------- the readings, pure

def test_vllm_reads_a_missing_norm_before_residual_as_true_only_in_the_speculators_format():
    layer = {"hidden_size": 64, "num_attention_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 256}
    spec = vllm.read_served({"speculators_model_type": "eagle3", "transformer_layer_config": layer})
    assert spec.norms["norm_before_residual"] is True and spec.norms["norm_before_fc"] is False
    assert spec.draft_vocab_size == 256  # missing: the target's whole vocabulary
    other = vllm.read_served({**layer, "eagle_config": {"norm_before_fc": True}})  # a SGLang/EAGLE-format config
    assert other.norms["norm_before_residual"] is False and other.norms["norm_before_fc"] is True
    assert vllm.read_served({"speculators_model_type": "eagle3", "transformer_layer_config": {}}).rms_norm_eps is None


def test_sglang_never_reads_norm_before_residual_and_takes_the_target_head_without_draft_vocab_size():
    got = sglang.read_served({"hidden_size": 64, "num_attention_heads": 4, "norm_before_residual": True})
    assert got.norms["norm_before_residual"] is False  # its decoder layer always adds the un-normed state
    assert got.lm_head == "target" and got.embedding == "target"
    assert sglang.read_served({"tie_word_embeddings": True, "draft_vocab_size": 8}).lm_head == "embedding"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "deepseek_v3"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_correct_exports_read_as_trained_on_every_target_model_file(tmp_path, engine, arch):
    target = tiny_target(arch, vocab_size=256, num_layers=8, hidden_size=64)
    native = make_native(tmp_path / "native", target, [2, 4, 5], draft_vocab=64)
    export_draft(native, engine, tmp_path / "out", target=target)
    draft, _, _ = load_draft(native)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    reading = read_fields(engine, config, tmp_path / "out", draft,
                          emb_rows=(torch.arange(256), target.embed_tokens.weight.detach()))
    assert reading.found == [], [m.meaning for m in reading.found]


def test_the_draft_as_served_with_norm_before_residual_computes_otherwise(chat_tiny_target, tmp_path):
    draft, _, _ = load_draft(make_native(tmp_path / "n", chat_tiny_target, [2, 4, 6]))
    served = vllm.read_served({"speculators_model_type": "eagle3", "transformer_layer_config": {
        **json.loads(json.dumps(speculators_layout.build_config(draft.config, [2, 4, 6], verifier_name=None,
                                                                verifier_architecture="LlamaForCausalLM", num_steps=3,
                                                                dtype="float32")["transformer_layer_config"]))},
        "draft_vocab_size": draft.config.draft_vocab_size, "target_hidden_size": draft.config.target_hidden_size})
    found = mismatches(served, draft.config)
    assert [m.field for m in found] == ["norm_before_residual"] and 'write "norm_before_residual": false' in found[0].fix
    built = as_served(draft, found)
    emb, h = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    pos = torch.arange(5)[None]
    assert not torch.allclose(built.forward_ttt(emb, h, pos, []), draft.forward_ttt(emb, h, pos, []))
    assert torch.equal(as_served(draft, []).forward_ttt(emb, h, pos, []), draft.forward_ttt(emb, h, pos, []))


# ---------------------------------------------------------------- the doctor, end to end

def _chats(tmp_path: Path) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": f"Here is my answer to: {p} " * 3}]}) + "\n"
        for i, p in enumerate(CHATS)))
    return str(path)


def _doctor(target, draft, chats, **kw):
    from eaglewire.doctor import run_doctor

    report = run_doctor(DoctorConfig(draft=str(draft), conversations=chats, engine_prompts=0, tune=False, **kw),
                        target=target)
    return {c.name: c for c in report.checks}, report


def test_doctor_fails_a_vllm_config_that_omits_norm_before_residual(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    export_draft(native, "vllm", tmp_path / "vllm", target=chat_tiny_target)
    chats = _chats(tmp_path)
    good, _ = _doctor(chat_tiny_target, native, chats, engine="vllm",
                      engine_config=str(tmp_path / "vllm" / "config.json"))
    assert good["engine fields"].verdict == "ok", good["engine fields"].evidence
    assert good["engine wiring"].verdict == "ok"
    config = _edit(tmp_path / "vllm", drop=("norm_before_residual",))
    checks, report = _doctor(chat_tiny_target, native, chats, engine="vllm", engine_config=str(config))
    fields = checks["engine fields"]
    assert fields.verdict == "fail" and "norm_before_residual" in fields.summary
    assert 'write "norm_before_residual": false' in fields.fix
    assert any("acc@0" in e and "as trained" in e for e in fields.evidence)
    assert "acc@0 as served" in report.accuracy and report.exit_code == 1


def test_doctor_names_an_absolute_d2t_in_the_served_directory(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    export_draft(native, "sglang", tmp_path / "sg")
    weights = tmp_path / "sg" / "model.safetensors"
    state = load_file(str(weights))
    state["d2t"] = state["d2t"] + torch.arange(state["d2t"].numel())  # the target ids, where offsets belong
    save_file(state, str(weights))
    checks, _ = _doctor(chat_tiny_target, native, _chats(tmp_path), engine="sglang",
                        engine_config=str(tmp_path / "sg" / "config.json"))
    fields = checks["engine fields"]
    assert fields.verdict == "fail" and "d2t" in fields.summary
    assert any("absolute target ids" in e for e in fields.evidence) and "d2t - arange" in fields.fix


# ---------------------------------------------------------------- wrapped (multimodal) targets

@pytest.mark.parametrize("arch, engine, path, served", [
    ("Gemma3ForConditionalGeneration", "vllm", "vllm/model_executor/models/gemma3_mm.py", None),
    ("LlavaForConditionalGeneration", "vllm", "vllm/model_executor/models/llava.py", [2, 15, 27]),
    ("Mistral3ForConditionalGeneration", "vllm", "vllm/model_executor/models/mistral3.py", [2, 15, 27]),
    ("Qwen2VLForConditionalGeneration", "vllm", "vllm/model_executor/models/qwen2_vl.py", None),
    ("Qwen2_5_VLForConditionalGeneration", "vllm", "vllm/model_executor/models/qwen2_5_vl.py", [2, 15, 27]),
    ("Gemma3ForConditionalGeneration", "sglang", "sglang/srt/models/gemma3_mm.py", None),
    ("LlavaForConditionalGeneration", "sglang", "sglang/srt/models/llava.py", None),
    ("Mistral3ForConditionalGeneration", "sglang", "sglang/srt/models/mistral.py", None),
    ("Qwen2VLForConditionalGeneration", "sglang", "sglang/srt/models/qwen2_vl.py", None),
    ("Qwen2_5_VLForConditionalGeneration", "sglang", "sglang/srt/models/qwen2_5_vl.py", [3, 16, 28]),
])
def test_wrapped_targets_are_read_through_the_wrappers_own_model_file(arch, engine, path, served):
    from eaglewire.doctor.engine_reading import read_engine_config
    from eaglewire.engines import get

    assert get(engine).linter.file_for(arch).path == path
    config = ({"eagle_aux_hidden_state_layer_ids": [2, 15, 27]} if engine == "vllm"
              else {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}})
    reading = read_engine_config(engine, config, 30, [2, 15, 27] if served is None else served, arch)
    if served is None:  # the wrapper serves no EAGLE-3 draft (or, Gemma 3 on SGLang, feeds other states)
        assert reading.problems and any(path.rsplit("/", 1)[1] in p or "gemma3" in p for p in reading.problems)
        assert "models/gemma3.py" not in " ".join(reading.problems)  # the wrapper's file, not the text model's
    else:
        assert list(reading.readings.values()) == [served] and not reading.problems


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_norm_before_fc_fix_names_the_section_the_engine_reads_and_applied_it_passes(tmp_path, engine):
    """eagle_config.norm_before_fc: true is read before the top-level key (SGLang and vLLM's non-speculators
    formats): a fix at the top level would leave the FAIL, so the fix names eagle_config, and applying it clears it."""
    target = tiny_target("llama", vocab_size=256, num_layers=8, hidden_size=64)
    native = make_native(tmp_path / "native", target, [2, 4, 5], draft_vocab=64)
    export_draft(native, "sglang", tmp_path / "out", target=target)
    draft, _, _ = load_draft(native)
    module = {"sglang": sglang, "vllm": vllm}[engine]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    config["eagle_config"] = {**(config.get("eagle_config") or {}), "norm_before_fc": True}
    [found] = [m for m in mismatches(module.read_served(config), draft.config) if m.field == "norm_before_fc"]
    assert 'inside "eagle_config"' in found.fix
    top_level_only = {**config, "norm_before_fc": False}  # the fix the doctor used to print: still read as true
    assert any(m.field == "norm_before_fc" for m in mismatches(module.read_served(top_level_only), draft.config))
    applied = {**config, "eagle_config": {**config["eagle_config"], "norm_before_fc": False}}
    assert not any(m.field == "norm_before_fc" for m in mismatches(module.read_served(applied), draft.config))
