"""`eaglewire tune --concurrency B1,B2,...`: the engine measured at each batch size and the schedule of where the
draft pays, written with the key of this setup. eaglewire's engine is measured in process (its steps timed whole:
concurrency/measurement.py) and its schedule is what ``serve --schedule`` reads; an engine launched here as a server
(llama-server, vLLM) is loaded with that many streams (concurrency/server_measurement.py), and since it cannot switch its
shape by load, its schedule says which launch pays up to which load."""

from __future__ import annotations

from pathlib import Path

from eaglewire.concurrency.measurement import ConcurrencyReport, measure_concurrency
from eaglewire.concurrency.schedule import ScheduleKey, draft_digest, parse_shapes, schedule_key
from eaglewire.engines import get as get_engine
from eaglewire.tune.tune_command import TuneConfig, tune_prompts, work_dir


def run_concurrency(config: TuneConfig, *, progress=lambda _: None) -> ConcurrencyReport:
    from eaglewire.core.presets import resolve_draft

    draft_dir = resolve_draft(config.draft)
    shapes = parse_shapes(config.concurrency_shapes)
    if get_engine(config.engine).in_process:
        report = _in_process(config, draft_dir, shapes, progress)
    else:
        report = _served(config, draft_dir, shapes, progress)
    report.schedule.notes = [f"tune --engine {config.engine} --concurrency {','.join(map(str, config.concurrency))}: "
                             f"{report.schedule.describe()}", *report.notes]
    if config.schedule_out:
        Path(config.schedule_out).parent.mkdir(parents=True, exist_ok=True)
        report.schedule.save(config.schedule_out)
    return report


def _in_process(config: TuneConfig, draft_dir: Path, shapes, progress) -> ConcurrencyReport:
    from eaglewire.decode.load import load_decoder

    decoder = load_decoder(config.target, str(draft_dir), shapes[-1], device=config.device, dtype=config.dtype)
    prompts = tune_prompts(config, decoder.target.tokenizer)
    report = measure_concurrency(decoder, prompts, config.concurrency, shapes, max_new_tokens=config.max_new_tokens,
                                 progress=progress)
    report.schedule.key = schedule_key(decoder.target, draft_dir)
    return report


def _served(config: TuneConfig, draft_dir: Path, shapes, progress) -> ConcurrencyReport:
    """The engine launched here per shape, loaded with each batch size's streams; the launch advice in the notes."""
    from eaglewire.concurrency.server_measurement import launch_advice, launched_shape, measure_server_concurrency
    from eaglewire.acceptance.speed import server_setup
    from eaglewire.model.checkpoint import read_draft
    from eaglewire.model.target import load_tokenizer

    spec = get_engine(config.engine)
    settings = config.run.settings()
    family = read_draft(draft_dir).family
    for shape in shapes:
        why = spec.runtime.can_run(launched_shape(shape), family)
        if why:
            raise ValueError(f"--shapes: {why}")
    setup = server_setup(config.engine, str(draft_dir), config.target, work_dir(config), settings)
    prompts = tune_prompts(config, load_tokenizer(config.target))
    report = measure_server_concurrency(spec.runtime, setup.files, settings, prompts, config.concurrency, shapes,
                                        tokens=config.load_tokens, each=2, max_new_tokens=config.max_new_tokens,
                                        log_dir=setup.log_dir, progress=progress)
    report.schedule.key = served_key(config, draft_dir)

    def spell(shape) -> str:
        launched = launched_shape(shape)
        return spec.chain_rule.label(launched.n_max, launched.p_min, 0, family == "dflash")

    report.notes += launch_advice(report.schedule, spell)
    return report


def served_key(config: TuneConfig, draft_dir: Path) -> ScheduleKey:
    """The key of a server engine's schedule: the target the draft was trained for (the engine loads its own copy),
    the draft, the engine's name and version, fp32 (as eaglewire launches it), this CPU, the engine's threads."""
    from eaglewire.core.machine import cpu
    from eaglewire.model.checkpoint import read_draft_config

    spec = get_engine(config.engine)
    settings = config.run.settings()
    trained_for = read_draft_config(draft_dir)["contract"]["target"]["weights_sha256"]
    return ScheduleKey(target=trained_for[:16], draft=draft_digest(draft_dir),
                       engine=f"{spec.name} {spec.runtime.version(settings)}", dtype="float32", device=cpu()[0],
                       threads=settings.threads)
