"""SGLang as a dependency that runs here: the registry's ``sglang`` ``VERSION_RUN`` in a venv of its own, with its
CPU kernels built from the pinned source (``kernels.py``).

What an installation is and where it lives: ``<cache>/engines/sglang-VERSION_RUN/`` holds ``venv/`` (sglang and
the torch it pins), ``kernels/`` (the source as patched and the build), ``set-aside/`` (the CUDA ``common_ops`` of
the ``sglang-kernel`` wheel, which would load first and register no CPU op) and ``eaglewire-sglang.json``, the
record that ``setup.install`` writes last, after SGLang's own kernel tests and a smoke serve passed: ``find``
accepts no venv without a good record, so a cut or failed install is never handed out.

``find`` also takes the user's own interpreter (``--sglang-python``): any python whose SGLang has the CPU ops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglewire.engines.serving.engine_venv import EngineHome, probe_python

log = logging.getLogger(__name__)

VERSION_RUN = "0.5.23"  # the sglang release eaglewire installs and runs here
DIST = "sglang"
INSTALL_HINT = "run `eaglewire engines install sglang` (or `make sglang`) once, or pass --sglang-python"
_OWN = "or run `eaglewire engines install sglang` (or `make sglang`) for eaglewire's own"
RECORD = "eaglewire-sglang.json"
RECORD_VERSION = 2  # bumped when what install does changes: an older record means reinstall (2: MoE experts)
NUMA_PACKAGE = "libnuma-dev"  # Debian's: numa.h and libnuma.so, which the kernels' numa_utils.cpp needs
_PROBE = ("import json, sys, importlib.util; from importlib.metadata import version, PackageNotFoundError\n"
          "def v(n):\n"
          "    try: return version(n)\n"
          "    except PackageNotFoundError: return None\n"
          "print(json.dumps({'prefix': sys.prefix, 'python': sys.version.split()[0], 'sglang': v('sglang'),"
          " 'torch': v('torch'), 'found': importlib.util.find_spec('sglang') is not None}))")
# does its sgl_kernel register the CPU ops (what the EAGLE path on a CPU runs)?
_OPS_PROBE = ("import torch, sgl_kernel, json; print(json.dumps({'cpu_ops': hasattr(torch.ops.sgl_kernel, "
              "'extend_attention_cpu'), 'file': getattr(sgl_kernel, 'common_ops', None) and "
              "sgl_kernel.common_ops.__file__}))")


class SglangError(RuntimeError):
    """SGLang is missing here, will not install, or did not serve."""


# ------------------------------------------------------------------ where

HOME = EngineHome(DIST, VERSION_RUN, RECORD, RECORD_VERSION)
install_dir, venv_dir, venv_python, record_path = HOME.install_dir, HOME.venv_dir, HOME.venv_python, HOME.record_path


def site_packages(prefix: Path) -> Path:
    found = sorted((prefix / "lib").glob("python3*/site-packages"))
    if not found:
        raise SglangError(f"{prefix} has no lib/python3*/site-packages")
    return found[0]


# ------------------------------------------------------------------ finding it

@dataclass(frozen=True, kw_only=True)
class Installation:
    python: Path  # the interpreter that runs SGLang
    prefix: Path  # its sys.prefix
    version: str | None  # sglang's distribution version
    how: str  # "installed", "cached", "given"
    record: dict[str, Any] | None = None  # eaglewire's own venv: what install recorded
    smoke: str | None = None  # what the smoke run proved here (None: not run)
    kept_intel_amx: bool = False  # its overrides.py carries the gate patch (kernels.GATE_PATCH)

    def rows(self) -> list[tuple[str, str]]:
        rows = [("python", str(self.python)), ("sglang", self.version or "unknown"), ("found", self.how)]
        record = self.record or {}
        if record:
            kernels = record.get("kernels", {})
            rows += [("torch", str(record.get("torch"))),
                     ("CPU kernels from", str(kernels.get("origin"))),
                     ("kernels built", f"{kernels.get('build_seconds', 0):.0f} s, {' '.join(kernels.get('cflags', []))}"),
                     ("kernels library", str(kernels.get("library"))),
                     ("changed", ", ".join(p.split(":")[0] for p in record.get("patches", [])) or "nothing"),
                     ("set aside", ", ".join(record.get("set_aside", [])) or "nothing"),
                     ("SGLang's kernel tests", str(record.get("kernel_tests"))),
                     ("installed on", str(record.get("cpu"))),
                     ("install took", f"{record.get('install_seconds', 0):.0f} s")]
        smoke = self.smoke or record.get("smoke")
        if smoke:
            rows.append(("smoke run here", smoke))
        return rows


def read_record(path: Path | None = None) -> dict[str, Any] | None:
    """The install's record, when it is complete and for this release (else None)."""
    return HOME.read_record(path)


def probe(python: str | Path, program: str = _PROBE, timeout: float = 300.0) -> dict[str, Any]:
    """What ``python`` prints as JSON for ``program`` (default: itself and sglang, without importing sglang)."""
    return probe_python(python, program, error=SglangError, timeout=timeout,
                        env={"SGLANG_USE_CPU_ENGINE": "1", "PATH": "/usr/bin:/bin"},
                        asked=f"--sglang-python: pass a python that imports sglang, {_OWN}")


def gate_patched(prefix: Path) -> bool:
    from eaglewire.engines.sglang.kernels import GATE_PATCH

    try:
        import re

        return bool(re.search(GATE_PATCH.done, (site_packages(prefix) / GATE_PATCH.file).read_text()))
    except (OSError, SglangError):
        return False


def _given(python: str | Path) -> Installation:
    path = Path(python).expanduser()
    if not path.is_file():
        raise SglangError(f"--sglang-python {python} is not a file: pass a python that imports sglang, {_OWN}")
    info = probe(path)
    if not info["found"]:
        raise SglangError(f"--sglang-python {python} cannot import sglang: pass a python that does, {_OWN}")
    ops = probe(path, _OPS_PROBE)
    if not ops.get("cpu_ops"):
        raise SglangError(f"--sglang-python {python}: its sgl_kernel registers no CPU ops (extend_attention_cpu), "
                          f"so SGLang's EAGLE path cannot run on a CPU with it; {_OWN}, which builds them")
    version = info["sglang"]
    if version and version != VERSION_RUN:
        log.warning("%s has SGLang %s; eaglewire launches and reads SGLang %s", python, version, VERSION_RUN)
    prefix = Path(info["prefix"])
    return Installation(python=path, prefix=prefix, version=version, how="given", kept_intel_amx=gate_patched(prefix))


def find(python: str | Path | None = None) -> Installation | None:
    """The SGLang to run: ``python`` (the user's interpreter: an SglangError, with the install command, when it
    lacks sglang or its CPU ops), else eaglewire's own venv when its record is good; None when there is none."""
    if python is not None:
        return _given(python)
    record = read_record()
    if record is None:
        return None
    return Installation(python=Path(record["python"]), prefix=venv_dir(), version=record["version"], how="cached",
                        record=record, kept_intel_amx=True)


def require(python: str | Path | None = None) -> Installation:
    found = find(python)
    if found is None:
        raise SglangError(f"SGLang is not installed (no complete install in {install_dir()}): {INSTALL_HINT}")
    return found


def no_record_reason() -> str:
    return f"SGLang is not installed: {INSTALL_HINT}"


