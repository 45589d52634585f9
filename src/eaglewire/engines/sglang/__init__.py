"""SGLang (0.5.23), one package: its readings (``readings.py``: ids per target model file, where its config keeps
them, its EAGLE-3 and DFlash formats and export, launch-flag lint, the chat template's switches, sampling) and
what a served draft computes and a running server says it accepted (``served.py``: ``doctor --engine-url``).
The id rules per model file are tabled at the top of ``readings.py``.
"""

from eaglewire.engines.sglang.readings import (
    NAME, VERSION, PER_MODEL_FILE, NEEDS_TARGET_ARCH, FILES, DFLASH_FILES, WRAPPER_FILES, file_for, refusal, layers_to_capture, to_ids,
    to_boundaries, families, readings_by_file, ambiguity, read_notes, cannot_feed, config_fix, build_config,
    num_aux, parse_config, read_ids, serving_md, export, reads_export, SPEC_FLAGS, FLAG_ALIASES, read_flags,
    lint_flags, DFLASH_FUNCTION, dflash_file_for, dflash_to_ids, dflash_to_boundaries, read_dflash_ids,
    dflash_config_fix, lint_dflash_flags, export_dflash, TEMPLATE_KWARGS_FLAG, launch_template_kwargs,
    template_kwargs_fix, ACCEPTANCE_RULE, launch_temperature,
)
from eaglewire.engines.sglang.served import (
    SERVED_CITED, read_served, served_config_key, SPEC_ACCEPT_LENGTH, SPEC_VERIFY_CALLS, GENERATION_TOKENS,
    RUNNING_REQUESTS, meta_spec, generate_ids, spec_gauges, measure_served,
)
from eaglewire.engines.interface import ChainRule, EngineSpec, Exporter, IdReading, Importer, Linter, Sampling  # noqa: E402
from eaglewire.engines.sglang.server import RUNTIME, served_flags, served_version  # noqa: E402
from eaglewire.engines.sglang.setup import INSTALLER  # noqa: E402
from eaglewire.engines.sglang.capture import CAPTURER  # noqa: E402


def _speculative_label(n_max: int, p_min: float, n_min: int, block: bool) -> str:
    return (f"--speculative-num-steps {n_max} --speculative-eagle-topk 1 --speculative-num-draft-tokens {n_max + 1}"
            + (" (a DFlash block)" if block else ""))


CHAIN_RULE = ChainRule(p_min_stops=False, label=_speculative_label)  # a fixed chain a round, no probability stop


def judged(served: str | None) -> tuple[str, str]:
    """Which release's reading judges an SGLang server that says it is ``served``."""
    if served == VERSION:
        return f"SGLang {VERSION}", f"judged with SGLang {VERSION}'s reading (the server says {served})"
    return f"SGLang {VERSION}", (f"judged with SGLang {VERSION}'s reading, the one eaglewire has; the server says "
                                 f"{served or 'no version (no /get_server_info)'}: another release may read the "
                                 "config otherwise")


SPEC = EngineSpec(
    name=NAME, version=VERSION, stated_costs=True, measure=measure_served, reads_export=reads_export,
    runtime=RUNTIME, installer=INSTALLER, capturer=CAPTURER, served_version=served_version, served_flags=served_flags, judged=judged, chain_rule=CHAIN_RULE,
    eagle3=IdReading(to_ids=to_ids, to_boundaries=to_boundaries, read_ids=read_ids, read_notes=read_notes,
                     per_model_file=PER_MODEL_FILE, needs_target_arch=NEEDS_TARGET_ARCH, families=families),
    dflash=IdReading(to_ids=dflash_to_ids, to_boundaries=dflash_to_boundaries, read_ids=read_dflash_ids),
    exporter=Exporter(export=export, export_dflash=export_dflash),
    importer=Importer(parse_config=parse_config),
    sampling=Sampling(acceptance_rule=ACCEPTANCE_RULE, launch_temperature=launch_temperature),
    linter=Linter(lint_flags=lint_flags, lint_dflash_flags=lint_dflash_flags, config_fix=config_fix,
                  dflash_config_fix=dflash_config_fix, read_served=read_served, served_config_key=served_config_key,
                  launch_template_kwargs=launch_template_kwargs, template_kwargs_fix=template_kwargs_fix,
                  template_kwargs_flag=TEMPLATE_KWARGS_FLAG, refusal=refusal, file_for=file_for,
                  cannot_feed=cannot_feed, num_aux=num_aux, norm_flags=("norm_before_fc", "fc_norm", "norm_output"),
                  d2t_reading="offsets", readings=readings_by_file, draft_embedding=False),  # read_served: the target's rows
)

__all__ = ["NAME", "VERSION", "PER_MODEL_FILE", "NEEDS_TARGET_ARCH", "FILES", "DFLASH_FILES", "WRAPPER_FILES", "file_for", "refusal", "layers_to_capture", "to_ids", "to_boundaries", "families", "readings_by_file", "ambiguity", "read_notes", "cannot_feed", "config_fix", "build_config", "num_aux", "parse_config", "read_ids", "serving_md", "export", "reads_export", "SPEC_FLAGS", "FLAG_ALIASES", "read_flags", "lint_flags", "DFLASH_FUNCTION", "dflash_file_for", "dflash_to_ids", "dflash_to_boundaries", "read_dflash_ids", "dflash_config_fix", "lint_dflash_flags", "export_dflash", "TEMPLATE_KWARGS_FLAG", "launch_template_kwargs", "template_kwargs_fix", "ACCEPTANCE_RULE", "launch_temperature", "SERVED_CITED", "read_served", "served_config_key", "SPEC_ACCEPT_LENGTH", "SPEC_VERIFY_CALLS", "GENERATION_TOKENS", "RUNNING_REQUESTS", "meta_spec", "generate_ids", "spec_gauges", "measure_served", "CHAIN_RULE", "judged", "SPEC"]
