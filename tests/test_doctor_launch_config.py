"""The config the launch flags name: with no ``--engine-config`` the doctor reads the draft directory
(or llama.cpp's ``-md`` GGUF) the flags load; given both, a ``--engine-config`` that is not what the
flags load FAILs and the loaded one is judged. Then an end-to-end doctor run FAILs a faulty config
named only by the flags (it used to WARN "cannot tell" and pass)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from eaglewire.doctor.checks import LaunchSettings, config_the_flags_load
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.verdicts import DoctorReport
from eaglewire.doctor.engine_reading import lint_flags

DECLARED, L = [2, 15, 27], 30


def config_dir(path, ids):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                                  "eagle_aux_hidden_state_layer_ids": ids}))
    return path


def launch(engine: str, draft) -> str:
    if engine == "vllm":
        return f"""--speculative-config '{{"method": "eagle3", "model": "{draft}", "num_speculative_tokens": 3}}'"""
    return f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} --speculative-num-steps 3"


def resolve(engine, flags, engine_config=None):
    report = DoctorReport(draft="d", target="t")
    launch = DoctorConfig(draft="d", engine=engine, engine_flags=flags, engine_config=engine_config
                          ).settings(LaunchSettings)
    named = lint_flags(engine, flags, DECLARED, L, "LlamaForCausalLM").draft_path  # as check_serving reads it
    got = config_the_flags_load(report, launch, named)
    return got.engine_config, {c.name: c for c in report.checks}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_flags_draft_directory_is_the_engine_config_when_none_is_given(tmp_path, engine):
    draft = config_dir(tmp_path / "draft", [0, 2, 15])
    used, checks = resolve(engine, launch(engine, draft))
    assert used == str(draft / "config.json") and checks["engine config"].verdict == "ok"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_engine_config_that_is_not_what_the_flags_load_fails_and_the_loaded_one_is_judged(tmp_path, engine):
    loaded = config_dir(tmp_path / "draft", [0, 2, 15])
    shown = config_dir(tmp_path / "other", DECLARED) / "config.json"
    used, checks = resolve(engine, launch(engine, loaded), str(shown))
    assert used == str(loaded / "config.json")
    assert checks["engine config"].verdict == "fail" and str(shown) in checks["engine config"].summary
    same = config_dir(tmp_path / "copy", [0, 2, 15]) / "config.json"  # the same config elsewhere: no fault
    assert resolve(engine, launch(engine, loaded), str(same)) == (str(same), {})


def test_flags_naming_no_local_directory_change_nothing(tmp_path):
    assert resolve("vllm", launch("vllm", "org/remote-draft")) == (None, {})
    assert resolve("sglang", "--speculative-algorithm EAGLE3") == (None, {})


def test_llamacpp_reads_the_md_gguf_of_the_flags(tmp_path):
    loaded, other = tmp_path / "draft.gguf", tmp_path / "other.gguf"
    loaded.write_bytes(b"GGUF one")
    other.write_bytes(b"GGUF two")
    flags = f"-md {loaded} --spec-type draft-eagle3"
    report = DoctorReport(draft="d", target="t")
    launch = DoctorConfig(draft="d", engine="llamacpp", engine_flags=flags).settings(LaunchSettings)
    got = config_the_flags_load(report, launch, str(loaded))
    assert got.engine_config == str(loaded) and report.checks[0].verdict == "ok"
    got = config_the_flags_load(report, replace(launch, engine_config=str(other)), str(loaded))
    assert got.engine_config == str(loaded) and report.checks[1].verdict == "fail"


def test_the_doctor_fails_a_faulty_config_named_only_by_the_flags(tmp_path, chat_tiny_target):
    """A random draft on [2, 4, 5] of a tiny target, served through flags naming a config with other ids."""
    from tiny import save_random_draft

    from eaglewire.doctor import run_doctor

    native = save_random_draft(tmp_path / "native", chat_tiny_target)
    served = config_dir(tmp_path / "served", [1, 2, 3])
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {i}"},
                                                      {"role": "assistant", "content": "ok " * 8}]}) + "\n"
                             for i in range(4)))
    config = DoctorConfig(draft=str(native), target="smollm2-135m", conversations=str(chats), engine="vllm",
                          engine_flags=launch("vllm", served), include_training=True, engine_prompts=1,
                          engine_tokens=4, min_tokens=1, tune=False)
    report = run_doctor(config, target=chat_tiny_target)
    checks = {c.name: c for c in report.checks}
    assert checks["engine config"].verdict == "ok" and str(served) in checks["engine config"].summary
    assert checks["engine wiring"].verdict == "fail" and report.exit_code == 1
