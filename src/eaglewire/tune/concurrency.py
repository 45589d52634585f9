"""`eaglewire tune --concurrency B1,B2,...`: eaglewire's engine measured at each batch size, the schedule of where
the draft pays (acceptance/concurrency.py), written for ``serve --schedule`` with the key of this setup."""

from __future__ import annotations

from pathlib import Path

from eaglewire.acceptance.concurrency import ConcurrencyReport, measure_concurrency
from eaglewire.decode.schedule import parse_shapes, schedule_key
from eaglewire.tune.run import TuneConfig, tune_prompts


def run_concurrency(config: TuneConfig, *, progress=lambda _: None) -> ConcurrencyReport:
    from eaglewire.decode.load import load_decoder
    from eaglewire.core.presets import resolve_draft

    draft_dir = resolve_draft(config.draft)
    shapes = parse_shapes(config.shapes)
    decoder = load_decoder(config.target, str(draft_dir), shapes[-1], device=config.device, dtype=config.dtype)
    prompts = tune_prompts(config, decoder.target.tokenizer)
    report = measure_concurrency(decoder, prompts, config.concurrency, shapes, max_new_tokens=config.max_new_tokens,
                                 progress=progress)
    report.schedule.key = schedule_key(decoder.target, draft_dir)
    report.schedule.notes = [f"tune --concurrency {','.join(map(str, config.concurrency))}: {report.schedule.describe()}",
                             *report.notes]
    if config.schedule_out:
        Path(config.schedule_out).parent.mkdir(parents=True, exist_ok=True)
        report.schedule.save(config.schedule_out)
    return report
