"""``eaglewire engines install|which sglang``: make the installation ``installation.py`` describes and prove it
(``INSTALLER``, the engine interface's ``Installer``).

From nothing, in ``<cache>/engines/sglang-VERSION_RUN`` (one install at a time, under a lock):
1. the CPU is checked (the kernels are AVX-512 with bf16) and ``numa.h`` found (``apt-get install libnuma-dev``
   as root where it is missing);
2. a venv gets the registry's ``sglang==VERSION_RUN`` and the torch it pins;
3. the kernels' source (``kernels.resolve_source``: the pinned archive, or ``--kernel-source``) is unpacked, the
   named patches applied (0.5.23's argument lists), compiled against the venv's torch, and installed as
   ``sgl_kernel/common_ops.so``, the CUDA ``common_ops`` of the sglang-kernel wheel moved to ``set-aside/``;
4. ``kernels.GATE_PATCH`` is applied to the venv's SGLang (the non-AMX fallback, opened by an environment flag);
5. SGLang's own CPU kernel tests of the pinned commit run, each file in its own process as SGLang's CI runs them;
6. a smoke serve: the reference EAGLE-3 draft on SmolLM2 (plain where no exporter is handed in);
7. the record is written last: only now does ``find`` accept the venv.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from eaglewire.core.fileio import atomic_write_json
from eaglewire.core.logged_run import run_logged
from eaglewire.engines.interface import ExportDraft, InstallError, InstallSettings, Progress, ServedFiles, Shape
from eaglewire.engines.serving.engine_venv import apt_install, can_apt, ensure_venv
import eaglewire.engines.sglang.installation as inst  # the module itself, not through the package
import eaglewire.engines.sglang.kernels as kernels  # the module itself, not through the package
from eaglewire.engines.sglang.installation import DIST, RECORD_VERSION, VERSION_RUN, Installation, SglangError
from eaglewire.engines.sglang.server import SglangServer

SMOKE_CHAIN = 3
NUMA_HEADERS = (Path("/usr/include/numa.h"),)
KERNEL_TEST_TIMEOUT = 900.0


def _no_progress(stage: str, percent: float | None) -> None:
    pass


def _run(cmd: list[str], logfile: Path, stage: str, progress: Progress, **kw: Any) -> None:
    run_logged(cmd, logfile, stage, progress, error=SglangError, **kw)


def repo_root() -> Path:
    """The checkout this eaglewire runs from (where ``../shared/third_party`` is looked for)."""
    return Path(__file__).resolve().parents[4]


def ensure_numa(logfile: Path, progress: Progress) -> str:
    """``numa.h`` on this machine: found, else installed with apt-get when running as root (CI), else an error."""
    if any(p.is_file() for p in NUMA_HEADERS):
        return "found"
    if not can_apt():
        raise SglangError(f"SGLang's CPU kernels include numa.h, which this machine lacks: install "
                          f"{inst.NUMA_PACKAGE} (apt-get install {inst.NUMA_PACKAGE}) and rerun")
    apt_install(inst.NUMA_PACKAGE, "the kernels include numa.h", logfile, progress, error=SglangError)
    return "installed with apt-get"


def install_kernels(python: Path, site: Path, library: Path, aside: Path) -> list[str]:
    """``library`` in as ``sgl_kernel/common_ops.so``; the wheel's CUDA ``common_ops`` (which sgl_kernel's loader
    tries first) moved under ``aside``. What was moved, relative to site-packages."""
    package = site / "sgl_kernel"
    moved = []
    for cuda in sorted(package.glob("sm*/common_ops*")):
        rel = cuda.relative_to(site)
        dest = aside / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(cuda), dest)
        moved.append(str(rel))
    shutil.copy2(library, package / "common_ops.so")
    return moved


def run_kernel_tests(python: Path, root: Path, logfile: Path, progress: Progress, threads: int) -> str:
    """SGLang's own CPU kernel tests (``kernels.KERNEL_TESTS``), one process per file; what they said."""
    tests = root / "cpu-tests-from-sglang" / "registered" / "cpu"
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS=str(threads))
    said = []
    for name in kernels.KERNEL_TESTS:
        module = name.removesuffix(".py")
        before = logfile.stat().st_size if logfile.exists() else 0
        _run([str(python), "-m", "unittest", module], logfile, f"SGLang's kernel tests: {name}", progress,
             timeout=KERNEL_TEST_TIMEOUT, env=env, cwd=tests)
        with open(logfile, errors="replace") as f:
            f.seek(before)
            ran = re.findall(r"Ran (\d+) tests?", f.read())
        said.append(f"{module} {ran[-1] if ran else '?'}")
    return ", ".join(said) + " passed"


def smoke_run(installation: Installation, *, export: ExportDraft | None, work: Path, log_path: Path | None = None,
              threads: int = 2, new_tokens: int = 8) -> dict[str, Any]:
    """Serve SmolLM2 with the reference EAGLE-3 draft (a chain of ``SMOKE_CHAIN``; plain where ``export`` is None)
    and generate ``new_tokens`` greedily; what it did, or SglangError with the server's log tail."""
    from eaglewire.engines.serving.served_target import served_target

    target = served_target("smollm2-135m", "SGLang", SglangError)
    draft, shape = None, Shape()
    if export is not None:
        draft = work / "smoke-draft"
        export("reference", "sglang", draft)
        shape = Shape(n_max=SMOKE_CHAIN)
    prompt = list(range(1000, 1016))
    with SglangServer(installation, ServedFiles(target=target, draft=draft), shape, threads=threads,
                      log_path=log_path) as server:
        answer = server.generate(prompt, max_new_tokens=new_tokens, temperature=0.0, seed=0)
    if len(answer.tokens) != new_tokens:
        raise SglangError(f"SGLang answered the smoke prompt with {len(answer.tokens)} tokens, not {new_tokens}")
    what = "plainly" if shape.plain else f"with the reference EAGLE-3 draft ({shape.label()})"
    return {"seconds_to_ready": round(server.seconds_to_ready or 0.0, 1), "tokens": answer.tokens,
            "smoke": (f"served SmolLM2-135M ({threads} threads) {what}: ready in {server.seconds_to_ready:.0f} s, "
                      f"{new_tokens} tokens, accept lengths {answer.stats.accept_lengths}")}


def install(settings: InstallSettings, progress: Progress | None = None) -> Installation:
    """Make SGLang available and proven to serve here; a no-op when eaglewire's venv has a good record.
    ``settings.install`` (``--sglang-python``): the user's interpreter, checked and smoke-run, used as it is."""
    from eaglewire.core.machine import cpu

    progress = progress or _no_progress
    jobs = settings.jobs or os.cpu_count() or 1
    if settings.install is not None:
        given = inst._given(settings.install)
        progress(f"smoke run: {given.python} serves SmolLM2", None)
        smoke = smoke_run(given, export=settings.export, work=inst.install_dir().parent / "sglang-given")
        return replace(given, smoke=smoke["smoke"])
    with inst.HOME.locked() as root:  # one install at a time
        found = inst.find()
        if found is not None:
            return found
        refused = kernels.cpu_refusal()
        if refused:
            raise SglangError(refused)
        start = time.monotonic()
        root.mkdir(exist_ok=True)
        inst.record_path().unlink(missing_ok=True)
        logfile = root / "eaglewire-install.log"
        numa = ensure_numa(logfile, progress)
        venv, py = inst.venv_dir(), ensure_venv(inst.HOME, logfile, progress, error=SglangError)
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
        _run([*pip, f"{DIST}=={VERSION_RUN}", "ninja"], logfile,
             f"installing {DIST}=={VERSION_RUN} and the torch it pins from the registry (~5 min)", progress)
        info = inst.probe(py)
        if not info["found"] or info["sglang"] != VERSION_RUN:
            raise SglangError(f"{py} does not import {DIST} {VERSION_RUN} after installing it ({info}); log {logfile}")
        site = inst.site_packages(venv)

        work = root / "kernels"
        source = kernels.resolve_source(settings.source, repo_root(), work, logfile)
        patches = [kernels.apply(source.root, p) for p in (*kernels.KERNEL_PATCHES, *kernels.TEST_PATCHES)]
        progress(f"compiling SGLang's CPU kernels from {source.origin} ({jobs} jobs, ~4-7 min on 2 cores)", None)
        build_start = time.monotonic()
        library = kernels.build(py, source.root, work / "build", logfile, jobs=jobs)
        build_seconds = time.monotonic() - build_start
        moved = install_kernels(py, site, library, root / "set-aside")
        patches.append(kernels.apply(site, kernels.GATE_PATCH))
        tests = run_kernel_tests(py, source.root, logfile, progress, threads=min(jobs, 2))

        installed = Installation(python=py, prefix=venv, version=VERSION_RUN, how="installed", kept_intel_amx=True)
        progress("smoke run: SGLang serves SmolLM2 with the reference draft (~1 min)", None)
        try:
            smoke = smoke_run(installed, export=settings.export, work=root, log_path=root / "eaglewire-smoke.log")
        except SglangError as e:
            raise SglangError(f"{e}\nSGLang {VERSION_RUN} installed into {venv} but does not serve on this machine "
                              f"({cpu()[0]}); the venv is kept unrecorded (a rerun of install completes it)") from None
        record = {"record_version": RECORD_VERSION, "version": VERSION_RUN, "python": str(py),
                  "python_version": info["python"], "torch": info["torch"], "cpu": cpu()[0], "numa": numa,
                  "kernels": {"origin": source.origin, "commit": kernels.KERNEL_COMMIT, "library": str(library),
                              "build_seconds": round(build_seconds, 1), "cflags": list(kernels.CFLAGS), "jobs": jobs},
                  "patches": patches, "set_aside": moved, "kernel_tests": tests,
                  "seconds_to_ready": smoke["seconds_to_ready"], "smoke": smoke["smoke"],
                  "smoke_tokens": smoke["tokens"], "install_seconds": round(time.monotonic() - start, 1),
                  "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        atomic_write_json(inst.record_path(), record)  # last: only now does find() accept the venv
    return replace(installed, record=record, smoke=smoke["smoke"])


class SglangInstaller:
    """``eaglewire engines install|which sglang [--sglang-python P] [--kernel-source S]``: an SglangError or a
    KernelError is an InstallError (its message printed as it is)."""

    title = f"SGLang ({DIST} {VERSION_RUN}, pinned; CPU kernels {kernels.KERNEL_COMMIT[:7]}, built here)"

    def install(self, settings: InstallSettings, progress: Progress) -> Installation:
        try:
            return install(settings, progress=progress)
        except (SglangError, kernels.KernelError) as e:
            raise InstallError(str(e)) from e

    def which(self, settings: InstallSettings) -> Installation:
        try:
            found = inst.find(settings.install)
        except SglangError as e:
            raise InstallError(str(e)) from e
        if found is None:
            raise InstallError(inst.no_record_reason())
        return found


INSTALLER = SglangInstaller()
