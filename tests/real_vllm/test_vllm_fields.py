"""The real vLLM serving the reference EAGLE-3 export with a draft config field it reads otherwise than the draft
was trained: ``"norm_before_residual": true`` in its config.json (vLLM's decoder layer then takes
``hidden_norm(h)`` as the residual; the draft was trained on ``h``: engines/vllm/readings.py ``NORM_FLAGS``,
``read_served``). The layer ids stay right, so the engine-wiring check cannot see it. One server start.

(a) offline, the doctor's engine-fields check FAILs the config and measures the draft as vLLM builds it from it
far below the draft as trained; (b) against the running server, the served check FAILs it: served τ far below
the replay of the same draft on the server's own text; and where the doctor has its served-wiring diagnosis
(doctor/served_tau/diagnosis.py), it names the flag.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from eaglewire.engines import export_draft
from eaglewire.engines.interface import RunSettings, ServedFiles, Shape
from real_vllm.test_vllm_served import _serve

pytestmark = [pytest.mark.vllm, pytest.mark.real]

CHAIN = 3
FLAG = "norm_before_residual"
SEQUENCES = 16  # the doctor's held-out sequences: 1,2xx judged tokens, above its 1,000 minimum


@pytest.fixture(scope="module", autouse=True)
def installed(vllm_installation):
    """Skip before any other fixture loads the target, where vLLM is absent."""
    return vllm_installation


@pytest.fixture(scope="module")
def flagged(tmp_path_factory, vllm_installation):
    """(work dir, the export with the flag set to what the draft was not trained with)."""
    from eaglewire.engines.vllm.server import RUNTIME

    work = tmp_path_factory.mktemp("vllm-fields")
    files = RUNTIME.files("reference", "smollm2-135m", work, RunSettings(install=str(vllm_installation.python)),
                          export=export_draft)
    bad = work / "vllm-export-norm-flag"
    shutil.copytree(files.draft, bad)
    config = json.loads((bad / "config.json").read_text())
    assert config[FLAG] is False  # what the export writes: the draft's residual is the un-normed state
    config[FLAG] = True
    (bad / "config.json").write_text(json.dumps(config, indent=2))
    return work, ServedFiles(target=files.target, draft=bad)


def _doctor(target, files: ServedFiles, **kw):
    from eaglewire.doctor.doctor_config import DoctorConfig
    from eaglewire.doctor.doctor_command import run_doctor

    report = run_doctor(DoctorConfig(draft="reference", engine="vllm", engine_config=str(files.draft / "config.json"),
                                     num_sequences=SEQUENCES, tune=False, **kw), target=target)
    return report, {c.name: c for c in report.checks}


@pytest.fixture(scope="module")
def offline(smollm2_target, flagged):
    """The doctor on the config alone: no server (``--engine-config`` without ``--engine-url``)."""
    return _doctor(smollm2_target, flagged[1], engine_prompts=0)


@pytest.fixture(scope="module")
def served(vllm_installation, smollm2_target, flagged):
    """The doctor against vLLM serving the flagged export (``--engine-url``), at a chain of CHAIN."""
    work, files = flagged
    (report, checks), record = _serve(vllm_installation, files, Shape(n_max=CHAIN), work / "norm-flag.log",
                                      lambda s: _doctor(smollm2_target, files, engine_url=s.url, engine_prompts=8,
                                                        engine_tokens=48))
    return report, checks, record


def test_offline_the_engine_fields_check_fails_the_flag_and_measures_the_draft_as_vllm_builds_it(offline):
    report, checks = offline
    fields = checks["engine fields"]
    acc = report.accuracy
    print(f"acc@0 as trained {acc['acc@0']:.3f}, as vLLM builds it {acc['acc@0 as served']:.3f}")
    assert fields.verdict == "fail" and FLAG in fields.summary, fields
    assert f'write "{FLAG}": false' in fields.fix
    assert any(line.startswith(f"{FLAG}: vLLM") and "reads True, trained False" in line for line in fields.evidence)
    assert report.accuracy["acc@0 as served"] < report.accuracy["acc@0"] - 0.2, report.accuracy
    assert checks["engine wiring"].verdict == "ok"  # the ids are right: the fault is the field alone
    assert "served acceptance" not in checks and report.exit_code != 0


def test_served_the_flag_is_served_far_below_the_replay_and_the_served_check_fails_it(served):
    report, checks, record = served
    tau, replayed = report.served["tau"], report.served["replayed_tau"]
    print(f"{FLAG} true: served τ {tau:.3f} (per position {report.served['per_position']}), replayed τ "
          f"{replayed:.3f} ({report.served['replayed_per_position']}), chain {report.served['chain']}")
    assert '"method": "eagle3"' in " ".join(record["command"]) and report.served["chain"] == CHAIN
    assert report.served["source"] == "per-request"
    assert replayed > 1.25  # the draft as trained earns this on the server's own text (chain 3, 8 prompts)
    assert tau < replayed - 0.2, (tau, replayed)
    check = checks["served acceptance"]
    assert check.verdict == "fail" and "serving-side fault" in check.summary, check
    assert checks["engine fields"].verdict == "fail" and checks["engine wiring"].verdict == "ok"
    assert checks["engine version"].verdict == "ok" and "0.32.0" in checks["engine version"].summary
    named = set(re.findall(r"(?i)\bvllm (\d+\.\d+\.\d+)", report.render()))
    assert named == {"0.32.0"}, named  # every line names the release that judged the server (issue 64)


def test_served_the_wiring_diagnosis_names_the_flag(served):
    from eaglewire import engines

    assert FLAG in engines.get("vllm").linter.norm_flags  # the flags the diagnosis replays are the ones vLLM reads
    report, checks, _ = served
    check = checks["served wiring"]
    print(f"served wiring: {check.verdict}: {check.summary}\nfix: {check.fix}")
    assert check.verdict == "fail", check
    match = report.served["diagnosis"]["match"]
    assert match is not None and FLAG in match["label"] + check.summary, report.served["diagnosis"]
    assert f'"{FLAG}": false' in check.fix
    assert match["layout"] == [2, 15, 27]  # the layers are the trained ones: only the field is read otherwise
