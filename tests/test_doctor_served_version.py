"""The doctor names the engine that serves by the version the server reports (issue 53, item 5): a vLLM 0.32.0
server's readings are "served by vllm 0.32.0" in the layout sweep, not the release eaglewire read them from."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from eaglewire import engines
from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.shards import ShardWriter
from eaglewire.doctor import DoctorConfig, run_doctor
from eaglewire.doctor.checks import served_labels
from eaglewire.doctor.layouts import candidate_layouts
from eaglewire.model.capture import capture
from eaglewire.model.target import load_target
from tiny import save_random_draft, save_tiny_dir

READ = engines.get("vllm").version  # the release eaglewire read vLLM's code from
SERVED = "0.32.0"


def test_served_labels_take_the_servers_version():
    serving = {f"vllm {READ}": [2, 15, 27], f"vllm {READ} (V1 runner)": [1, 14, 26]}
    got = served_labels(serving, READ, SERVED)
    assert got == {"vllm 0.32.0": [2, 15, 27], "vllm 0.32.0 (V1 runner)": [1, 14, 26]}
    assert "served by vllm 0.32.0" in candidate_layouts([2, 15, 27], 30, got)[(2, 15, 27)]
    assert served_labels(serving, READ, None) == serving  # the server says nothing: the release read
    assert served_labels(serving, None, SERVED) == serving  # an engine with no release in its labels


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


def test_the_sweep_names_the_version_the_server_reports(setup, monkeypatch):
    root, target_dir, target = setup
    real = engines.get
    def get(name, *args, **kwargs):
        spec = real(name, *args, **kwargs)
        return dataclasses.replace(spec, served_version=lambda url: SERVED) if spec.name == "vllm" else spec

    monkeypatch.setattr(engines, "get", get)
    monkeypatch.setattr("eaglewire.doctor.run.check_served", lambda *a, **k: None)  # no server here
    report = run_doctor(DoctorConfig(draft=str(root / "draft"), target=str(target_dir), data=str(root / "data"),
                                     include_training=True, engine_prompts=0, min_tokens=1, tune=False,
                                     engine="vllm", engine_config=str(root / "config.json"),
                                     engine_url="http://127.0.0.1:1"), target=target)
    assert report.engine_version == SERVED
    labels = [label for row in report.layouts for label in row.labels if label.startswith("served by")]
    assert labels and all(label.startswith(f"served by vllm {SERVED}") for label in labels), labels
    text = report.render()
    assert f"vllm {SERVED}" in text and f"served by vllm {READ}" not in text
