"""vLLM, one package: its readings (ids per version x model file, how it reads the speculators format, export,
lint, served fields and counters) in ``readings.py``; for running it here, ``installation.py`` (its own venv) and
``server.py`` (a ``vllm serve`` process)."""

from eaglewire.engines.vllm.readings import (
    NAME,
    FORMAT_NAME,
    VERSION,
    PER_MODEL_FILE,
    FILES,
    WRAPPER_FILES,
    file_for,
    refusal,
    to_ids,
    to_boundaries,
    read_notes,
    cannot_feed,
    config_fix,
    parse_config,
    read_ids,
    id_readings,
    num_aux,
    serving_md,
    export_arch,
    export,
    reads_export,
    FLAG_ALIASES,
    detect_method,
    lint_flags,
    SERVED_CITED,
    read_served,
    served_config_key,
    METRICS_PREFIX,
    measure_served,
    DFLASH_CITED,
    dflash_to_ids,
    dflash_to_boundaries,
    lint_dflash_flags,
    read_dflash_ids,
    dflash_config_fix,
    parse_dflash_config,
    export_dflash,
    TEMPLATE_KWARGS_FLAG,
    ACCEPTANCE_RULE,
    launch_temperature,
    launch_template_kwargs,
    template_kwargs_fix,
)
from eaglewire.engines.interface import ChainRule, EngineSpec, Exporter, IdReading, Importer, Linter, Sampling  # noqa: E402
from eaglewire.engines.vllm.capture import CAPTURER  # noqa: E402
from eaglewire.engines.vllm.server import RUNTIME, served_version  # noqa: E402
from eaglewire.engines.vllm.setup import INSTALLER  # noqa: E402
from eaglewire.engines.vllm.versions import reading_for, version_line  # noqa: E402


def _speculative_label(n_max: int, p_min: float, n_min: int, block: bool) -> str:
    return f'--speculative-config \'{{"num_speculative_tokens": {n_max}}}\'' + (" (a DFlash block)" if block else "")


CHAIN_RULE = ChainRule(p_min_stops=False, label=_speculative_label)  # a fixed k drafted a round, no probability stop


def judged(served: str | None) -> tuple[str, str]:
    """Which release's reading judges a vLLM server that says it is ``served`` (engines/vllm/versions.py)."""
    reading = reading_for(served)
    return reading.engine, version_line(reading, served)


SPEC = EngineSpec(
    name=NAME, aliases=(FORMAT_NAME,), version=VERSION, stated_costs=True, measure=measure_served, runtime=RUNTIME,
    installer=INSTALLER,
    capturer=CAPTURER,
    served_version=served_version, judged=judged, chain_rule=CHAIN_RULE,
    reads_export=reads_export,
    eagle3=IdReading(to_ids=to_ids, to_boundaries=to_boundaries, read_ids=read_ids, read_notes=read_notes,
                     per_model_file=PER_MODEL_FILE),
    dflash=IdReading(to_ids=dflash_to_ids, to_boundaries=dflash_to_boundaries, read_ids=read_dflash_ids),
    exporter=Exporter(export=export, export_dflash=export_dflash, pruned_dflash=True),
    importer=Importer(parse_config=parse_config, parse_dflash_config=parse_dflash_config),
    sampling=Sampling(acceptance_rule=ACCEPTANCE_RULE, launch_temperature=launch_temperature),
    linter=Linter(lint_flags=lint_flags, lint_dflash_flags=lint_dflash_flags, config_fix=config_fix,
                  dflash_config_fix=dflash_config_fix, read_served=read_served, served_config_key=served_config_key,
                  launch_template_kwargs=launch_template_kwargs, template_kwargs_fix=template_kwargs_fix,
                  template_kwargs_flag=TEMPLATE_KWARGS_FLAG, refusal=refusal, file_for=file_for,
                  cannot_feed=cannot_feed, num_aux=num_aux,
                  norm_flags=("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"),
                  d2t_reading="offsets"),
)

__all__ = ["NAME", "FORMAT_NAME", "VERSION", "PER_MODEL_FILE", "FILES", "WRAPPER_FILES", "file_for", "refusal", "to_ids", "to_boundaries", "read_notes", "cannot_feed", "config_fix", "parse_config", "read_ids", "id_readings", "num_aux", "serving_md", "export_arch", "export", "reads_export", "FLAG_ALIASES", "detect_method", "lint_flags", "SERVED_CITED", "read_served", "served_config_key", "METRICS_PREFIX", "measure_served", "DFLASH_CITED", "dflash_to_ids", "dflash_to_boundaries", "lint_dflash_flags", "read_dflash_ids", "dflash_config_fix", "parse_dflash_config", "export_dflash", "TEMPLATE_KWARGS_FLAG", "ACCEPTANCE_RULE", "launch_temperature", "launch_template_kwargs", "template_kwargs_fix", "SPEC"]
