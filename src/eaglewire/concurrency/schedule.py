"""Which step a batch of sequences runs, by how many share it: a speculative shape, or plain decoding.

A verify pass of k tokens is nearly free next to a plain step at one request and costs ever more as the batch fills
the machine, so past some batch size plain decoding wins. A ``Schedule`` is a list of ranges of batch sizes, each
with the shape that pays there (None: plain); ``tune --concurrency`` measures it (concurrency/measurement.py) and
writes it with the ``ScheduleKey`` of what it was measured on; ``serve --schedule FILE`` reads it and refuses one
measured elsewhere, naming the field that differs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from eaglewire.core.errors import CorruptFileError
from eaglewire.decode.spec_config import SpecConfig


@dataclass(frozen=True)
class ScheduleKey:
    """What a schedule's costs were measured on: a schedule from another setup predicts nothing here."""

    target: str  # the target's weights fingerprint
    draft: str  # the draft's fingerprint
    engine: str  # "eaglewire 0.x", "vllm 0.32.0", ...
    dtype: str
    device: str  # the CPU's or GPU's name
    threads: int

    def differences(self, other: ScheduleKey) -> list[str]:
        """``field: ours != theirs`` for every field that differs."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class ScheduleRange:
    """Batch sizes up to ``max_batch`` (from the previous range's + 1) run ``shape``; None: plain decoding."""

    max_batch: int
    shape: SpecConfig | None


@dataclass
class Schedule:
    """Ranges of ascending ``max_batch``; batch sizes past the last range run its choice."""

    ranges: list[ScheduleRange]
    key: ScheduleKey | None = None
    notes: list[str] = field(default_factory=list)  # what tune measured, for people reading the file

    def __post_init__(self) -> None:
        if not self.ranges:
            raise ValueError("a schedule needs at least one range of batch sizes")
        bounds = [r.max_batch for r in self.ranges]
        if bounds != sorted(set(bounds)) or bounds[0] < 1:
            raise ValueError(f"a schedule's ranges end at ascending batch sizes >= 1; got {bounds}")

    @classmethod
    def fixed(cls, shape: SpecConfig | None) -> Schedule:
        """One shape (or plain) at every batch size: what a server without a schedule runs."""
        return cls([ScheduleRange(1, shape)])

    def shape_for(self, batch: int) -> SpecConfig | None:
        """The shape a step of ``batch`` live sequences runs (None: plain)."""
        for r in self.ranges:
            if batch <= r.max_batch:
                return r.shape
        return self.ranges[-1].shape

    @property
    def shapes(self) -> list[SpecConfig]:
        """The speculative shapes it uses, once each."""
        out: list[SpecConfig] = []
        for r in self.ranges:
            if r.shape is not None and r.shape not in out:
                out.append(r.shape)
        return out

    @property
    def max_steps(self) -> int:
        """The deepest shape's drafted tokens a round (0: plain at every size)."""
        return max((s.num_steps for s in self.shapes), default=0)

    @property
    def crossover(self) -> int | None:
        """The largest batch size at which it speculates (None: never; the last range speculating: no limit, -1)."""
        if self.ranges[-1].shape is not None:
            return -1
        speculating = [r.max_batch for r in self.ranges if r.shape is not None]
        return speculating[-1] if speculating else None

    def describe(self) -> str:
        """One line: 'chain 3 up to 4 concurrent requests, plain above'."""
        if len(self.ranges) == 1:
            only = self.ranges[0].shape
            return f"{'plain' if only is None else shape_name(only)} at every number of concurrent requests"
        parts, low = [], 1
        for i, r in enumerate(self.ranges):
            last = i == len(self.ranges) - 1
            what = "plain" if r.shape is None else shape_name(r.shape)
            span = f"from {low}" if last and low > 1 else (f"up to {r.max_batch}" if not last else "at every size")
            parts.append(f"{what} {span}")
            low = r.max_batch + 1
        return ", ".join(parts) + " concurrent requests"

    def check_key(self, here: ScheduleKey) -> None:
        """Refuse a schedule measured on another setup, naming what differs."""
        if self.key is None:
            return
        if diff := self.key.differences(here):
            raise ValueError(f"this schedule was measured on another setup ({'; '.join(diff)}: the file's value "
                             "first, this server's second); run `eaglewire tune --concurrency ...` here to measure "
                             "one for this setup")

    # -- the file ----------------------------------------------------------

    def to_dict(self) -> dict:
        return {"ranges": [{"max_batch": r.max_batch, "shape": None if r.shape is None else asdict(r.shape)}
                           for r in self.ranges],
                "key": None if self.key is None else asdict(self.key), "notes": self.notes}

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        ranges = [ScheduleRange(int(r["max_batch"]), None if r["shape"] is None else SpecConfig(**r["shape"]))
                  for r in data["ranges"]]
        key = None if data.get("key") is None else ScheduleKey(**data["key"])
        return cls(ranges, key, list(data.get("notes", [])))

    def save(self, path: str | Path) -> None:
        from eaglewire.core.fileio import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load_for(cls, path: str | Path, target, draft_dir: str | Path) -> Schedule:
        """``load``, refused unless measured on this target, draft and setup (``check_key``)."""
        schedule = cls.load(path)
        schedule.check_key(schedule_key(target, draft_dir))
        return schedule

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"no schedule at {path}; write one with `eaglewire tune --concurrency 1,2,4,8 "
                             f"--schedule-out {path}`") from None
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptFileError(f"{path} is not a schedule tune wrote ({type(e).__name__}: {e}); write it again with "
                             "`eaglewire tune --concurrency ...`") from None


def schedule_key(target, draft_dir: str | Path, threads: int | None = None) -> ScheduleKey:
    """The key of eaglewire's own engine here: the target's weights, the draft file's bytes, eaglewire's version,
    the decoding dtype, the device's name and the thread count (torch's, unless given)."""
    import torch

    from eaglewire import __version__
    from eaglewire.core.machine import cpu

    device = target.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu()[0]
    return ScheduleKey(target=target.fingerprint.weights_sha256[:16], draft=draft_digest(draft_dir),
                       engine=f"eaglewire {__version__}", dtype=str(target.dtype).removeprefix("torch."),
                       device=name, threads=threads or torch.get_num_threads())


def draft_digest(draft_dir: str | Path) -> str:
    """The draft's fingerprint in a key: the sha256 of its tensor files' bytes, 16 hex digits."""
    import hashlib

    from eaglewire.model.checkpoint import read_draft

    digest = hashlib.sha256()
    for tensor_file in sorted(Path(read_draft(draft_dir).path).glob("*.safetensors")):
        digest.update(tensor_file.read_bytes())
    return digest.hexdigest()[:16]


def concurrent(n: int | str) -> str:
    """'1 concurrent request', '4 concurrent requests' (any other count or range, plural)."""
    return f"{n} concurrent request" + ("" if str(n) == "1" else "s")


def shape_name(spec: SpecConfig) -> str:
    """'chain 3', 'tree 5/4/8' (num_steps / topk / num_draft_tokens), with ' p0.1' for a --draft-min-prob."""
    name = f"chain {spec.num_steps}" if spec.topk == 1 else f"tree {spec.num_steps}/{spec.topk}/{spec.num_draft_tokens}"
    return name + (f" p{spec.min_prob:g}" if spec.min_prob > 0 else "")


def parse_shapes(text: str, flag: str = "--shapes") -> list[SpecConfig]:
    """';'-separated steps,topk,draft-tokens[,min-prob] -> SpecConfigs ('3,1,4;5,4,12,0.1')."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = part.split(",")
        try:
            if len(fields) not in (3, 4):
                raise ValueError(f"{len(fields)} numbers")
            shapes.append(SpecConfig(num_steps=int(fields[0]), topk=int(fields[1]), num_draft_tokens=int(fields[2]),
                                     min_prob=float(fields[3]) if len(fields) == 4 else 0.0))
        except ValueError as e:
            raise ValueError(f"{flag}: {part!r} is not steps,topk,draft-tokens[,min-prob] ({e}); separate shapes "
                             "with ';', e.g. '1,1,2;3,1,4;5,4,12,0.1'") from None
    if not shapes:
        raise ValueError(f"{flag} is empty; give e.g. '1,1,2;3,1,4'")
    return shapes
