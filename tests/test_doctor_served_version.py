"""The doctor names the engine that serves by the release that judges it (issue 53, item 5; issue 64, item 1): a
vLLM 0.32.0 server's readings are "served by vllm 0.32.0" in the layout sweep, and every other line of the report
(the engine wiring check's readings, the fields' meanings) says 0.32.0 too, not the release eaglewire read them
from."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from eaglewire import engines
from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.shards import ShardWriter
from eaglewire.doctor import DoctorConfig, run_doctor
from eaglewire.doctor.checks import judged_release
from eaglewire.model.boundary_capture import capture
from eaglewire.model.target import load_target
from tiny import save_random_draft, save_tiny_dir

READ = engines.get("vllm").version  # the release eaglewire read vLLM's code from
SERVED = "0.32.0"


def test_a_line_names_the_release_that_judges_the_server():
    say = judged_release("vllm", f"vLLM {SERVED}")
    assert say(f"vllm {READ} (V1 runner) captures boundaries [1, 14, 26]") == \
        f"vllm {SERVED} (V1 runner) captures boundaries [1, 14, 26]"
    assert say(f"vLLM {READ} sizes the draft; vLLM {READ}'s reading.") == \
        f"vLLM {SERVED} sizes the draft; vLLM {SERVED}'s reading."
    assert say(f"vllm {READ}.1 and sglang {READ}") == f"vllm {READ}.1 and sglang {READ}"  # another release, engine
    assert judged_release("vllm", None) is None  # the server was not asked
    assert judged_release("vllm", f"vLLM {READ}") is None  # judged by the release read: nothing to rename


@pytest.fixture
def setup(tmp_path):
    target_dir = save_tiny_dir(tmp_path / "target")
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    contract = HiddenStateContract(aux_boundaries=(2, 4, 5), target=target.fingerprint)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(tmp_path / "data", contract, source={"test": True}) as w:
        for i in range(4):
            ids = torch.randint(0, 256, (1, 16), generator=g)
            got = capture(target, ids, contract)
            w.add(f"s{i}", ids[0], torch.arange(16) >= 4, got.aux_hidden[0], got.last_hidden[0])
    save_random_draft(tmp_path / "draft", target, aux_boundaries=(2, 4, 5))
    (tmp_path / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 4, 6],
                                                      "num_aux_hidden_states": 3}))
    return tmp_path, target_dir, target


def doctor_a_vllm_server(setup, monkeypatch, **kw):
    """The doctor with --engine-url of a vLLM server that says it is SERVED (its served checks left out)."""
    root, target_dir, target = setup
    real = engines.get

    def get(name, *args, **kwargs):
        spec = real(name, *args, **kwargs)
        return dataclasses.replace(spec, served_version=lambda url: SERVED) if spec.name == "vllm" else spec

    monkeypatch.setattr(engines, "get", get)
    monkeypatch.setattr("eaglewire.doctor.doctor_command.check_served", lambda *a, **k: None)  # no server here
    return run_doctor(DoctorConfig(draft=str(root / "draft"), target=str(target_dir), data=str(root / "data"),
                                   include_training=True, engine_prompts=0, min_tokens=1, tune=False,
                                   engine="vllm", engine_config=str(root / "config.json"),
                                   engine_url="http://127.0.0.1:1", **kw), target=target)


def test_the_sweep_names_the_version_the_server_reports(setup, monkeypatch):
    report = doctor_a_vllm_server(setup, monkeypatch)
    assert report.engine_version == SERVED
    labels = [label for row in report.layouts for label in row.labels if label.startswith("served by")]
    assert labels and all(label.startswith(f"served by vllm {SERVED}") for label in labels), labels
    text = report.render()
    assert f"vllm {SERVED}" in text and f"served by vllm {READ}" not in text


def test_every_line_names_the_release_the_server_is_judged_with(setup, monkeypatch, tmp_path):
    """The engine version check says "judged with vLLM 0.32.0's reading"; the engine wiring check's readings, the
    engine fields' meanings and the JSON say 0.32.0 too, never the 0.33.0 eaglewire read the code of."""
    report = doctor_a_vllm_server(setup, monkeypatch, json=str(tmp_path / "report.json"))
    checks = {c.name: c for c in report.checks}
    assert f"vLLM {SERVED}'s reading" in checks["engine version"].summary
    assert f"vllm {SERVED} captures boundaries [2, 4, 6]" in checks["engine wiring"].evidence
    for text in (report.render(), (tmp_path / "report.json").read_text()):
        named = set(re.findall(r"(?i)\bvllm (\d+\.\d+\.\d+)", text))
        assert named == {SERVED}, named
