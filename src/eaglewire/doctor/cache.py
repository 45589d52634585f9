"""The doctor's reuse of its own work: every check that depends only on the draft, the target, the
held-out data and the settings (the capture at every candidate boundary, isolation accuracy, the layout
sweep, eaglewire's own decoding, sampling, traffic, speed) is stored after a run and read back by the
next run with the same inputs, so a check of a running server (``--engine-url``) measures only what can
have changed: the server. Keyed by the content of everything those checks read, and by eaglewire's own
source (a changed doctor recomputes); ``--no-cache`` recomputes.

One JSON file per key under ``cache_root()``, written atomically: two doctors at once each write a
whole file, and a file that cannot be read is a miss, never an error."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eaglewire.doctor.verdicts import Check, DoctorReport, LayoutRow

log = logging.getLogger(__name__)

FORMAT = 1
# Settings that only say where to send or write, or how long the served diagnosis may probe: the checks
# cached never read them.
NOT_READ = frozenset({"engine_url", "probe_tokens", "json", "cache"})
# Settings that name files: their content is keyed, not only their path.
FILES = ("engine_config", "traffic", "data", "conversations")


def cache_root() -> Path:
    """``$EAGLEWIRE_DOCTOR_CACHE``, or ``doctor/`` in the user cache (``$EAGLEWIRE_CACHE``)."""
    import os

    from eaglewire.core.presets import cache_dir

    named = os.environ.get("EAGLEWIRE_DOCTOR_CACHE")
    return Path(named) if named else cache_dir() / "doctor"


@functools.cache
def source_digest() -> str:
    """sha256 of eaglewire's own Python source: a changed doctor never reads an older one's results."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _file_digest(path: Path, h) -> None:
    """Fold a file's or a directory's content (every file under it, by relative name) into ``h``."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)


def _tensor_digest(t: torch.Tensor | None, h) -> None:
    if t is None:
        h.update(b"none")
        return
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def cache_key(settings: dict[str, Any], draft_dir: Path, target, sequences: list,
              server_version: str | None = None) -> str:
    """sha256 of what the cached checks read: the settings (every flag by name, ``config_record``; files named by
    content), the draft's files, the target's fingerprint and device, the held-out sequences (tokens, masks,
    stored states), the threads, the version a running server reports (it names the layouts swept), and
    eaglewire's source."""
    h = hashlib.sha256(f"eaglewire doctor cache {FORMAT} {source_digest()}".encode())
    read = {k: v for k, v in settings.items() if k not in NOT_READ}
    h.update(json.dumps(read, sort_keys=True, default=str).encode())
    for name in FILES:
        value = settings.get(name)
        if value and Path(value).exists():
            h.update(name.encode())
            _file_digest(Path(value), h)
    _file_digest(Path(draft_dir), h)
    h.update(json.dumps(asdict(target.fingerprint), sort_keys=True).encode())  # weights sampled, not read whole:
    spec = Path(str(getattr(target, "spec", "") or ""))  # so the file the target came from, by size and time
    for p in ([spec] if spec.is_file() else sorted(spec.glob("*.safetensors")) if spec.is_dir() else []):
        st = p.stat()
        h.update(f"{p.resolve()} {st.st_size} {st.st_mtime_ns}".encode())
    h.update(f"{target.device} {torch.get_num_threads()} {server_version}".encode())
    for s in sequences:
        h.update(s.id.encode())
        for t in (s.input_ids, s.loss_mask, s.stored_aux, s.stored_last):
            _tensor_digest(t, h)
    return h.hexdigest()


@dataclass
class Cached:
    """The checks a run computed without the server, in report order around the served check."""

    before: list[Check]  # held-out measurements, before the served check
    after: list[Check]  # traffic and speed, after it
    layouts: list[LayoutRow]
    accuracy: dict[str, float]
    facts: dict[str, Any]
    extras: dict[str, Any]  # report.sampling, report.traffic and report.concurrency
    stage_seconds: dict[str, float]  # what they cost when computed
    created: str

    def restore_before(self, report: DoctorReport) -> None:
        report.checks += self.before
        report.layouts = list(self.layouts)
        report.accuracy |= self.accuracy
        report.sampling = dict(self.extras.get("sampling") or {})

    def restore_after(self, report: DoctorReport) -> None:
        report.checks += self.after
        report.traffic = dict(self.extras.get("traffic") or {})
        report.concurrency = dict(self.extras.get("concurrency") or {})

    @property
    def saved_seconds(self) -> float:
        return round(sum(self.stage_seconds.values()), 1)


def load(key: str, root: Path | None = None) -> Cached | None:
    path = (root or cache_root()) / f"{key}.json"
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        return Cached(before=[Check(**c) for c in raw["before"]], after=[Check(**c) for c in raw["after"]],
                      layouts=[LayoutRow(**r) for r in raw["layouts"]], accuracy=raw["accuracy"],
                      facts=raw["facts"], extras=raw["extras"], stage_seconds=raw["stage_seconds"],
                      created=raw["created"])
    except (OSError, ValueError, KeyError, TypeError) as e:  # truncated or from another format: recompute
        log.warning("doctor cache %s unreadable (%s): recomputing", path, e)
        return None


def store(key: str, cached: Cached, root: Path | None = None) -> Path | None:
    """Write ``cached`` under ``key``; a full disk or a read-only cache loses only the reuse."""
    from eaglewire.core.fileio import atomic_write_json

    path = (root or cache_root()) / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"format": FORMAT, "created": cached.created,
                                 "before": [asdict(c) for c in cached.before],
                                 "after": [asdict(c) for c in cached.after],
                                 "layouts": [asdict(r) for r in cached.layouts], "accuracy": cached.accuracy,
                                 "facts": cached.facts, "extras": cached.extras,
                                 "stage_seconds": cached.stage_seconds})
        return path
    except OSError as e:
        log.warning("doctor cache not written to %s (%s): the next run recomputes", path, e)
        return None


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
