"""The pinned engine releases, fetched once into the user cache (``pip download --no-deps``).

Only an unreachable package registry skips these tests; a missing version, or a wheel that
no longer holds the code read, fails them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eaglewire.engines.sglang import VERSION as SGLANG_VERSION
from eaglewire.engines.vllm import VERSION as VLLM_VERSION
from eaglewire.engines.vllm.versions import READINGS as VLLM_READINGS
from eaglewire.core.presets import cache_dir

PINNED = {"sglang": SGLANG_VERSION, "vllm": VLLM_VERSION}
UNREACHABLE = ("Could not fetch URL", "NewConnectionError", "Failed to establish a new connection",
               "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
               "ConnectTimeoutError", "ReadTimeoutError", "ProxyError")


def _fetch(name: str, version: str, into: Path) -> Path:
    found = sorted(into.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0]
    into.mkdir(parents=True, exist_ok=True)
    # the wheels' own tags, whatever this machine is: only their .py files are read
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                          "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                          "--platform", "manylinux_2_28_x86_64", f"{name}=={version}", "-d", str(into)],
                         capture_output=True, text=True, timeout=900)
    found = sorted(into.glob(f"{name}-{version}-*.whl"))
    if run.returncode == 0 and found:
        return found[0]
    if any(s in run.stderr + run.stdout for s in UNREACHABLE):
        pytest.skip(f"the package registry is unreachable, so {name}=={version} cannot be fetched: "
                    f"{run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.stdout[-200:]}")
    pytest.fail(f"pip download {name}=={version} failed (the registry answered):\n{run.stderr[-2000:]}")


class Wheel:
    """Python sources of one wheel, read without installing (or importing) it."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self._trees: dict[str, ast.Module] = {}

    def text(self, path: str) -> str:
        try:
            return self.zip.read(path).decode()
        except KeyError:
            pytest.fail(f"{self.path.name} has no {path}: the code eaglewire's reading cites moved; re-read it")

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.text(path))
        return self._trees[path]

    def names(self, prefix: str) -> list[str]:
        return [n for n in self.zip.namelist() if n.startswith(prefix) and n.endswith(".py")]


@pytest.fixture(scope="session")
def wheels() -> dict[str, Wheel]:
    into = cache_dir() / "engines" / "wheels"
    return {name: Wheel(_fetch(name, version, into)) for name, version in PINNED.items()}


@pytest.fixture(scope="session")
def vllm_wheels(wheels) -> dict[str, Wheel]:
    """Every vLLM release with a recorded reading (engines/vllm/versions.py READINGS) -> its wheel, fetched
    the same way; the pinned one is ``wheels["vllm"]`` itself."""
    into = cache_dir() / "engines" / "wheels"
    return {version: wheels["vllm"] if version == VLLM_VERSION else Wheel(_fetch("vllm", version, into))
            for version in VLLM_READINGS}


# The peers whose capture writers tests/data/test_foreign_writers.py runs (pure-Python wheels,
# read without installing): speculators' data generation and SpecForge's capture schema.
PEERS = {"speculators": "0.9.0", "specforge": "0.2.0"}


def peer_wheels() -> dict[str, Wheel]:
    """The peers' pinned wheels and vLLM's (its hidden-states connector writes speculators' files)."""
    into = cache_dir() / "engines" / "wheels"
    return {name: Wheel(_fetch(name, version, into)) for name, version in {**PEERS, "vllm": VLLM_VERSION}.items()}
