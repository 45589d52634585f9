"""``doctor --concurrency B1,B2,...``: the speed check for that many requests at once. A verify of k tokens is
nearly free next to a plain step at one request and costs ever more as the batch fills the machine, so a shape
that pays for one request may not pay for eight. eaglewire's own engine is measured here at each batch size in
the shape tune recommends for one request (``concurrency/measurement.py``, few steps: ``tune --concurrency``
measures more shapes, longer, and writes the schedule ``serve --schedule`` follows); an engine that runs in its
own server is measured under load by ``eaglewire tune``, whose command the check names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglewire.concurrency.measurement import ConcurrencyReport, measure_concurrency, verdict
from eaglewire.acceptance.recommend import MANY_REQUESTS
from eaglewire.core.device import device_field
from eaglewire.concurrency.schedule import Schedule, concurrent, shape_name
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.doctor.verdicts import Check, DoctorReport

# Steps timed per (batch size, shape) after WARMUP: the doctor's look, not tune's measurement.
WARMUP, REPEATS = 1, 6


@dataclass(frozen=True)
class LoadSettings:
    """What the speed check under load reads: the loads, the tokens per request, and the draft, target and device
    the commands it names run on (the fields are the doctor flags of the same name, filled by ``doctor_config``)."""

    concurrency: list[int] | None
    engine_tokens: int
    draft: str
    target: str
    device: str


def load_levels(concurrency: list[int] | None) -> list[int] | None:
    """The batch sizes ``--concurrency`` asks about; None when that is one request (the speed check as ever)."""
    return None if not concurrency or concurrency == [1] else list(concurrency)


def levels_text(levels: list[int]) -> str:
    return ",".join(map(str, levels))


def schedule_commands(load: LoadSettings) -> str:
    """The commands that measure every shape at ``--concurrency``'s loads and serve by load."""
    where = f" --target {load.target}" + (f" --device {load.device}" if load.device != device_field().default else "")
    return (f"eaglewire tune --draft {load.draft}{where} --concurrency {levels_text(load.concurrency)} "
            f"--schedule-out schedule.json, then eaglewire serve{where} --draft {load.draft} "
            "--schedule schedule.json")


def load_verdict(schedule: Schedule, levels: list[int], rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(ok or warn, the sentence): up to how many concurrent requests speculation pays in ``schedule``
    (``rows``: ``level_rows``, which say whether a shape that does not pay was slower or within the noise)."""
    crossover, ranges = schedule.crossover, schedule.ranges
    if crossover is None and any(row["verdict"] == "within noise" for row in rows):
        return "warn", (f"speculation does not pay beyond the noise of {REPEATS} steps at any load measured "
                        f"({levels_text(levels)}): serve plain, or measure longer with `eaglewire tune --concurrency`")
    if crossover is None:
        return "warn", f"speculation does not pay at any load measured ({levels_text(levels)}): serve plain"
    if all(r.shape is not None for r in ranges):
        return "ok", f"speculation pays at every load measured (up to {max(levels)} concurrent requests)"
    if crossover != -1 and all(r.shape is not None for r in ranges if r.max_batch <= crossover):
        return "warn", f"speculation pays up to {concurrent(crossover)} here; above that serve plain"
    return "warn", f"speculation pays at some loads only: {schedule.describe()}"


def level_rows(measured: ConcurrencyReport) -> list[dict[str, Any]]:
    """Per batch size and shape: its and plain's predicted tokens/s and step costs, their ratio and noise, and
    whether it pays (or why not: slower than plain, or faster by less than the noise)."""
    plain = {p.batch: p for p in measured.predictions if p.shape is None}
    rows = []
    for p in (p for p in measured.predictions if p.shape is not None):
        name = shape_name(p.shape)
        rows.append({"batch": p.batch, "shape": name, "tokens_per_second": round(p.tokens_per_second, 2),
                     "plain_tokens_per_second": round(plain[p.batch].tokens_per_second, 2),
                     "speedup": round(p.speedup, 3), "noise": round(p.noise, 4), "pays": p.kept,
                     "verdict": "pays" if p.kept else verdict(p),
                     "ms_per_step": round(1e3 * measured.costs[(p.batch, name)].median, 3),
                     "plain_ms_per_step": round(1e3 * measured.costs[(p.batch, "plain")].median, 3)})
    return rows


def row_line(row: dict[str, Any]) -> str:
    """One batch size's evidence line."""
    return (f"batch {row['batch']}: {row['shape']} {row['tokens_per_second']:.1f} tokens/s against plain "
            f"{row['plain_tokens_per_second']:.1f} ({row['speedup']:.2f}x, noise ±{row['noise']:.1%}): "
            f"{row['verdict']}")


def check_speed_under_load(report: DoctorReport, load: LoadSettings, target, draft, contract,
                           prompts: list[list[int]], ranking, evidence: list[str]) -> Check:
    """The speed check at ``--concurrency``'s batch sizes in eaglewire's engine: the one-request choice of
    ``ranking`` (``rank_speed``) measured beside plain at each on ``prompts``, the figures kept in
    ``report.concurrency``. A plain choice is not measured: a batch makes a verify dearer, not cheaper."""
    from eaglewire.decode.spec_decoder import SpecDecoder

    levels = load_levels(load.concurrency)
    choice, reason = ranking.recommendation.choice, ranking.recommendation.reason
    if choice.shape.plain:
        report.concurrency = {"levels": levels, "measured": False, "shape": None}
        return Check("speed", "warn", f"{reason}; speculation does not pay even at 1 request, so not at "
                     f"{levels_text(levels)} concurrent requests either (a batch makes a verify dearer): serve plain",
                     evidence)
    shape = SpecConfig.chain(choice.shape.n_max, min_prob=choice.shape.p_min)  # eaglewire's spelling of the shape
    measured = measure_concurrency(SpecDecoder(target, draft, contract, shape), prompts, levels, [shape],
                                   max_new_tokens=max(load.engine_tokens, 16), warmup=WARMUP, repeats=REPEATS)
    rows = level_rows(measured)
    status, sentence = load_verdict(measured.schedule, levels, rows)
    report.concurrency = {"levels": levels, "measured": True, "shape": shape_name(shape),
                          "tau": round(measured.taus[shape_name(shape)], 3), "crossover": measured.schedule.crossover,
                          "schedule": measured.schedule.describe(), "rows": rows,
                          "steps_timed": REPEATS, "notes": measured.notes}
    commands = schedule_commands(load)
    lines = [f"at 1 request: {reason.removesuffix('; ' + MANY_REQUESTS)}", *evidence,
             f"{shape_name(shape)} at {levels_text(levels)} concurrent requests (τ {report.concurrency['tau']:.2f}, "
             f"{REPEATS} steps timed per batch size; {'; '.join(measured.notes)}):",
             *map(row_line, rows),
             f"schedule: {measured.schedule.describe()}"]
    if status == "ok":
        lines.append(f"tune measures more shapes at these loads and writes the schedule: {commands}")
    return Check("speed", status, f"{choice.shape.label(ranking.rule)}: {sentence}", lines,
                 fix=commands if status == "warn" else None)


def check_load_elsewhere(report: DoctorReport, levels: list[int], draft: str, spec) -> None:
    """An engine in its own server (``spec``) under ``levels`` (``--concurrency``'s loads) with ``draft``: measured
    by ``eaglewire tune`` in servers it launches, not here."""
    name = spec.name
    if spec.runtime is None:  # an engine eaglewire does not launch here: the user's own server is loaded
        report.concurrency = {"levels": levels, "measured": False, "engine": name, "command": None}
        report.add(Check("speed under load", "skip", f"{name} does not run here, so it cannot be loaded with "
                         f"{levels_text(levels)} concurrent requests here: load your own {name} server with that many "
                         "clients, plain launch beside the speculative one (speculation pays while the speculative "
                         "launch's tokens/s beats plain's)"))
        return
    command = f"eaglewire tune --engine {name} --draft {draft} --concurrency {levels_text(levels)}"
    report.concurrency = {"levels": levels, "measured": False, "engine": name, "command": command}
    report.add(Check("speed under load", "skip", f"{spec.runtime.label} under load is measured in the servers "
                     f"`eaglewire tune` launches, not here: `{command}`", fix=command))
