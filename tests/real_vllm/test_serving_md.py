"""SERVING.md of a vLLM export, run as written: ``eaglewire export --draft reference --to vllm``, its ``vllm serve``
block taken verbatim and run with the vLLM venv's ``bin/`` first on PATH (one server start), then the doctor line
it gives pointed at that server.

What the block does not say and a CPU launch needs comes from eaglewire's own launcher (``launch_env``): the KV
cache size (``VLLM_CPU_KVCACHE_SPACE``: unset, vLLM's CPU worker reserves ``--gpu-memory-utilization`` 0.92 of
the machine's RAM, vllm/v1/worker/cpu_worker.py, and refuses to start where less is free), the worker's threads
(``VLLM_CPU_OMP_THREADS_BIND``) and the preloads; the port is appended (``--port``: vLLM's API server reads it
from no environment variable; ``VLLM_PORT`` is its internal one), and ``--enforce-eager``, as SERVING.md's CPU
paragraph says to (torch.compile takes minutes to start on 2 cores, and died at start in 2 of 5 launches here).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from real_vllm.test_vllm_served import _group_gone

pytestmark = [pytest.mark.vllm, pytest.mark.real]

STARTUP_TIMEOUT = 900.0  # torch.compile of the target and the draft head: ~3.5 min on 2 cores


@pytest.fixture(scope="module", autouse=True)
def installed(vllm_installation):
    """Skip before anything is exported, where vLLM is absent."""
    return vllm_installation


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the export directory, its SERVING.md), written by the CLI as a user would."""
    from eaglewire.cli import main

    out = tmp_path_factory.mktemp("serving-md") / "vllm-export"
    assert main(["export", "--draft", "reference", "--to", "vllm", "--out", str(out)]) == 0
    return out, (out / "SERVING.md").read_text()


def serve_block(text: str) -> list[str]:
    """The ``vllm serve`` command of SERVING.md's one bash block, as the shell would split it."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert len(blocks) == 1, blocks
    argv = shlex.split(blocks[0].replace("\\\n", ""))  # the shell's reading: backslash-newline continues the line
    assert argv[:2] == ["vllm", "serve"], argv
    return argv


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() - start < STARTUP_TIMEOUT:
        if proc.poll() is not None:
            pytest.fail(f"`vllm serve` as SERVING.md writes it exited with {proc.returncode} while starting; "
                        f"log {log}:\n{''.join(log.read_text(errors='replace').splitlines(True)[-30:])}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"`vllm serve` was not healthy within {STARTUP_TIMEOUT:.0f} s; log {log}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s, until no member is left."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not (proc.poll() is not None and _group_gone(pgid)):
            time.sleep(0.2)
        if proc.poll() is not None and _group_gone(pgid):
            break
    if proc.poll() is None:
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def running(exported, vllm_installation):
    """`vllm serve` as SERVING.md writes it, on a free port: (argv, url, log, seconds to healthy, completion,
    doctor exit code and report, whether the group was gone after the stop)."""
    from eaglewire.engines.vllm.server import allowed_cpus, free_port, launch_env, KV_SPACE_GIB

    out, text = exported
    argv = serve_block(text)
    port = free_port()
    env = launch_env(2, preload=vllm_installation.preload, cpus=allowed_cpus(), kv_space_gib=KV_SPACE_GIB)
    env["PATH"] = str(Path(vllm_installation.python).parent) + os.pathsep + env.get("PATH", "")
    log = out.parent / "vllm-serve.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([*argv, "--port", str(port), "--enforce-eager"], env=env, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=out.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        seconds = _wait_healthy(proc, url, log)
        body = json.dumps({"model": argv[2], "prompt": "The capital of France is", "max_tokens": 8,
                           "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            completion = json.loads(r.read())
        doctor = _doctor_as_written(text, url)
    finally:
        _stop(proc)
    return argv, url, log, seconds, completion, doctor, _group_gone(proc.pid)


def _doctor_as_written(text: str, url: str):
    """SERVING.md's doctor line with its placeholders filled (DRAFT: the draft exported; HOST:8000: the server),
    parsed by the CLI's own parser; its report."""
    from eaglewire.cli import build_parser
    from eaglewire.core.configs import config_from_args
    from eaglewire.doctor.doctor_config import DoctorConfig
    from eaglewire.doctor.doctor_command import run_doctor

    line = re.search(r"`(eaglewire doctor [^`]*)`", text).group(1)
    argv = shlex.split(line.replace("DRAFT", "reference").replace("http://HOST:8000", url))
    assert argv[:2] == ["eaglewire", "doctor"], argv
    return run_doctor(config_from_args(DoctorConfig, build_parser().parse_args(argv[1:])))


def test_the_export_serving_md_shows_one_vllm_serve_command_for_this_export(exported):
    out, text = exported
    argv = serve_block(text)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "eagle3" and spec["model"] == str(out.resolve())
    config = json.loads((out / "config.json").read_text())
    assert Path(argv[2]) == Path(config["speculators_config"]["verifier"]["name_or_path"])
    assert "--port" not in argv  # the test appends one: vLLM reads the API port from no environment variable


def test_the_serve_command_as_written_starts_answers_and_stops(running, exported):
    argv, url, log, seconds, completion, _, gone = running
    out, _ = exported
    text = log.read_text(errors="replace")
    print(f"`{' '.join(argv)}` healthy after {seconds:.0f} s; answered {completion['choices'][0]['text']!r}")
    assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] > 0
    ids = json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    assert f"Using auxiliary layers from speculative config: {tuple(ids)}" in text
    assert "method='eagle3'" in text and gone, "the server's process group outlived SIGTERM"


def test_the_doctor_line_as_written_judges_the_served_draft_as_the_replay(running):
    report = running[5]
    checks = {c.name: c for c in report.checks}
    served = checks["served acceptance"]
    print(f"doctor: served τ {report.served['tau']:.3f} vs replayed {report.served['replayed_tau']:.3f} "
          f"({report.served['source']}, chain {report.served['chain']}): {served.verdict}: {served.summary}")
    assert served.verdict in ("ok", "warn"), served
    assert report.served["chain"] == 5  # SERVING.md's num_speculative_tokens


def test_serving_md_says_what_a_cpu_launch_needs(exported):
    """The block as written reserves 0.92 of the machine's RAM on vLLM's CPU build (no VLLM_CPU_KVCACHE_SPACE) and
    compiles for minutes: SERVING.md must say what a CPU launch sets, as eaglewire's own launcher does."""
    _, text = exported
    assert "VLLM_CPU_KVCACHE_SPACE" in text, "SERVING.md says nothing of vLLM's CPU build: see this module's docstring"
    assert "--enforce-eager" in text
