"""Fixes the doctor and export used to print that did not work when applied: each fault rebuilt, its message read,
the fix applied as printed, and the run after it passes (or goes on)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire.core.contract import ContractError, EngineConventionError
from eaglewire.doctor.checks import LaunchSettings, check_serving
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.verdicts import DoctorReport
from eaglewire.engines import export_draft
from test_formats import make_native

QWEN2_VL = "Qwen2VLForConditionalGeneration"
DECLARED, L = [2, 4, 5], 8


@pytest.fixture(scope="module")
def qwen2_vl_draft(tmp_path_factory):
    from eaglewire.model.target import target_from_config
    from test_wrappers import wrapper_config

    target = target_from_config(wrapper_config("qwen2_vl"))
    assert target.fingerprint.architecture == QWEN2_VL
    return make_native(tmp_path_factory.mktemp("qwen2vl") / "draft", target, DECLARED, draft_vocab=64), target


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_export_no_engine_serves_names_the_one_that_does_and_llamacpps_reason(qwen2_vl_draft, tmp_path, engine):
    """SGLang's refusal used to say "serve it with vLLM", vLLM's "serve it with SGLang": both refuse it."""
    draft, target = qwen2_vl_draft
    with pytest.raises(EngineConventionError) as e:
        export_draft(draft, engine, tmp_path / "out", target=target)
    text = str(e.value)
    assert "engines that serve it: eaglewire;" in text
    other = "vllm" if engine == "sglang" else "sglang"
    assert f"{other} does not either" in text and "serve it with" not in text
    assert "llamacpp does not either (llama.cpp build" in text and "qwen2vl" in text and "t_layer_inp" in text


def test_the_doctor_fails_an_engine_that_serves_no_draft_for_the_target_without_a_config():
    """It used to PASS with no --engine-config; the fix names the engine that serves it, and that passes."""
    for engine in ("vllm", "sglang"):
        report = DoctorReport(draft="d", target="t")
        check_serving(report, DoctorConfig(draft="d", engine=engine).settings(LaunchSettings), DECLARED, L, QWEN2_VL)
        [check] = [c for c in report.checks if c.name == "engine architecture"]
        assert check.verdict == "fail" and check.fix == "serve it with eaglewire (doctor --engine eaglewire)"
        engine = re.search(r"--engine (\w+)", check.fix).group(1)
        report = DoctorReport(draft="d", target="t")
        launch = DoctorConfig(draft="d", engine=engine).settings(LaunchSettings)
        readings, _, _ = check_serving(report, launch, DECLARED, L, QWEN2_VL)
        assert not report.failed and readings == {"eaglewire": DECLARED}
    report = DoctorReport(draft="d", target="t")  # a target vLLM serves: no such check
    check_serving(report, DoctorConfig(draft="d", engine="vllm").settings(LaunchSettings), DECLARED, L,
                  "LlamaForCausalLM")
    assert not any(c.name == "engine architecture" for c in report.checks)


def test_a_foreign_drafts_other_embedding_is_allowed_by_the_flag_the_error_names(tmp_path, chat_tiny_target):
    """A vLLM export carrying another model's embed_tokens: the doctor refuses it naming --allow-target-mismatch
    weights_sha256, which it used to ignore (the same error again); given, the doctor runs and its engine-fields
    check measures the draft with the embedding vLLM will use."""
    from eaglewire.doctor import run_doctor

    native = make_native(tmp_path / "native", chat_tiny_target, DECLARED)
    export_draft(native, "vllm", tmp_path / "vllm", target=chat_tiny_target)
    weights = tmp_path / "vllm" / "model.safetensors"
    state = load_file(str(weights))
    rows = state["embed_tokens.weight"]
    state["embed_tokens.weight"] = rows[torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))]
    save_file(state, str(weights))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                                      {"role": "assistant", "content": "ok " * 8}]}) + "\n"
                             for i in range(4)))
    config = dict(draft=str(tmp_path / "vllm"), conversations=str(chats), engine="vllm",
                  engine_config=str(tmp_path / "vllm" / "config.json"), include_training=True, engine_prompts=0,
                  min_tokens=1, tune=False)
    with pytest.raises(ContractError) as e:
        run_doctor(DoctorConfig(**config), target=chat_tiny_target)
    flag, value = re.search(r"(--allow-target-mismatch) (\w+)", str(e.value)).groups()
    report = run_doctor(DoctorConfig(**config, allow_target_mismatch=[value]), target=chat_tiny_target)
    checks = {c.name: c for c in report.checks}
    assert any("allowed" in line for line in [checks["draft format"].summary, *checks["draft format"].evidence])
    assert checks["engine fields"].verdict == "fail" and "embed_tokens" in checks["engine fields"].summary
    assert "acc@0 as served" in report.accuracy  # measured with the checkpoint's own rows, as vLLM drafts


# ---------------------------------------------------------------- launch-flag fixes, applied to the flags

def _apply_flag_fix(flags: str, fix: str) -> str:
    """``flags`` with a lint's fix applied the way a user reads it: ``"key": value`` into the JSON of
    --speculative-config, ``[add] --flag value`` replacing that flag (or appended)."""
    import shlex

    tokens = shlex.split(flags)
    if fix.startswith('"'):
        i = tokens.index("--speculative-config") + 1
        tokens[i] = json.dumps({**json.loads(tokens[i]), **json.loads("{" + fix + "}")})
        return shlex.join(tokens)
    new = shlex.split(fix.removeprefix("add "))
    for name, value in zip(new[::2], new[1::2]):
        if name in tokens:
            tokens[tokens.index(name) + 1] = value
        else:
            tokens += [name, value]
    return shlex.join(tokens)


SPEC = '{"method": "eagle3", "model": "/served/draft"%s}'


@pytest.mark.parametrize("engine, flags", [
    ("sglang", "--speculative-draft-model-path /served/draft --speculative-num-steps 3"),
    ("vllm", "--speculative-config '" + SPEC % ', "num_speculative_tokens": 0' + "'"),
    ("vllm", "--speculative-config '" + SPEC % ', "num_speculative_tokens": -1' + "'"),
    ("vllm", "--speculative-config '" + SPEC % "" + "'"),
    ("llamacpp", "-md /served/draft.gguf --spec-type draft-eagle3 --spec-draft-n-max 0"),
    ("llamacpp", "-md /served/draft.gguf --spec-type draft-eagle3 --spec-draft-n-min 5"),
])
def test_each_launch_flag_fail_is_fixed_by_its_printed_fix(engine, flags):
    from eaglewire.doctor.engine_reading import lint_flags

    def fails(f):
        return [(what, fix) for verdict, what, fix in lint_flags(engine, f, DECLARED, L, "LlamaForCausalLM").problems
                if verdict == "fail"]

    found = fails(flags)
    assert found, flags
    for _, fix in found:
        flags = _apply_flag_fix(flags, fix)
    assert fails(flags) == [], flags


def test_an_export_of_a_preset_target_names_a_directory_vllm_can_load(smollm2_target):
    """SERVING.md said `vllm serve smollm2-135m`, a name vLLM cannot load: a preset is named by the transformers
    directory its GGUF was dequantized into."""
    from pathlib import Path
    from types import SimpleNamespace

    from eaglewire.engines.export import ExportConfig, verifier

    named = verifier(ExportConfig(), SimpleNamespace(target_spec="smollm2-135m"))
    assert Path(named).is_dir() and (Path(named) / "config.json").is_file() and named != "smollm2-135m"
    assert verifier(ExportConfig(verifier_name="org/model"), SimpleNamespace(target_spec="smollm2-135m")) == "org/model"
