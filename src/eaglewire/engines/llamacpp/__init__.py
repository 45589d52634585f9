"""llama.cpp (pinned build ``BUILD``), the one engine eaglewire installs, runs and measures here.

| module       | what it owns                                                              |
|--------------|---------------------------------------------------------------------------|
| readings.py  | ids (``extract_layers``: boundaries verbatim, exactly 3), servable target archs, GGUF types |
| installation.py | finding or building ``llama-server`` and the source tree (converter, gguf-py) |
| build_config.py | the cmake options for this CPU (its own ISA, AMX off on x86), the build's record |
| smoke.py     | the smoke run that proves a built server runs here (a Q8_0 GGUF, two threads) |
| failure.py   | ``LlamaCppError``, a server's exit in words                             |
| server.py    | a llama-server process, ``/completion``, its Prometheus ``/metrics``      |
| gguf.py      | the EAGLE-3 export (the converter over the vLLM export), reading a GGUF draft back |
| dflash_export.py | the DFlash export (the converter over z-lab's layout; a pruned vocabulary's d2t) |
| lint.py      | llama-server's speculative launch flags                                   |
| served.py    | every field llama.cpp computes a draft GGUF with (its own token_embd, norm before fc, eps, RoPE) |
| draft_file.py | what it makes of the files it serves: the target's architecture, the GGUF draft's boundaries, layout fix, d2t |
"""

from eaglewire.engines.interface import ChainRule, EngineSpec, Exporter, IdReading, Linter, Sampling
from eaglewire.engines.llamacpp.dflash_export import export_dflash
from eaglewire.engines.llamacpp.gguf import (converter_target_dir, dflash_layout_problem, draft_layers, export,
                                             gguf_tensor, layout_problem, vocab_problem,
                                             read_gguf_metadata, run_converter, serving_md, target_architecture,
                                             target_gguf)
from eaglewire.engines.llamacpp.build_config import BuildPlan, BuildRecord, plan_for, read_record
from eaglewire.engines.llamacpp.failure import LlamaCppError
from eaglewire.engines.llamacpp.installation import (BUILD, CONVERTER, INSTALL_HINT, INSTALLER, SDIST, SERVER, Installation,
                                                build_server, built_server, download_sdist,
                                                find_server, find_tree, install, require_server, require_tree,
                                                server_build, server_record, source_dir, unpack_tree)
from eaglewire.engines.llamacpp.smoke import SmokeFailed, smoke_run
from eaglewire.engines.llamacpp.lint import (ACCEPTANCE_RULE, DEFAULT_N_MAX, TEMPLATE_KWARGS_FLAG, LlamaFlags,
                                            launch_temperature, launch_template_kwargs,
                                            lint_dflash_flags, lint_flags, template_kwargs_fix)
from eaglewire.engines.llamacpp.draft_file import (DRAFT_FILE_FIX, VOCAB_FIX, arch_reading, draft_file_layers,
                                                   draft_file_layout, draft_file_vocab, layout_fix, target_file_arch)
from eaglewire.engines.llamacpp.readings import (NAME, DFLASH_GGUF_ARCH, DRAFT_OUTTYPES, EAGLE3_TARGET_ARCHS, GGUF_ARCH, HF_TO_LLAMACPP_ARCH,
                                                 NUM_AUX, TARGET_OUTTYPES, layer_input_archs, llamacpp_arch,
                                                 dflash_to_boundaries, dflash_to_ids, reads_export, refusal, to_boundaries,
                                                 to_ids)
from eaglewire.engines.llamacpp.server import (LlamaServer, ServerConfig, chain_config, complete, free_port, metrics,
                                               parse_metrics, plain_server_config, server_args, spec_flags)
from eaglewire.engines.llamacpp.server import measure_served  # doctor --engine-url (engines/serving/served_counts.py)

__all__ = [
    "BuildPlan", "BuildRecord", "plan_for", "read_record", "server_record", "SmokeFailed", "smoke_run",
    "gguf_tensor", "vocab_problem",
    "measure_served", "ACCEPTANCE_RULE", "launch_temperature", "launch_template_kwargs", "template_kwargs_fix", "TEMPLATE_KWARGS_FLAG",
    "BUILD", "CONVERTER", "DEFAULT_N_MAX", "DRAFT_OUTTYPES", "EAGLE3_TARGET_ARCHS", "GGUF_ARCH", "HF_TO_LLAMACPP_ARCH",
    "INSTALL_HINT", "NAME", "NUM_AUX", "SDIST", "SERVER", "TARGET_OUTTYPES", "Installation", "LlamaCppError", "LlamaFlags",
    "LlamaServer", "ServerConfig", "build_server", "built_server", "chain_config", "complete", "converter_target_dir",
    "DFLASH_GGUF_ARCH", "dflash_layout_problem", "dflash_to_boundaries", "dflash_to_ids", "download_sdist",
    "draft_layers", "export", "export_dflash", "find_server", "find_tree", "free_port", "install",
    "layer_input_archs", "layout_problem", "lint_dflash_flags", "lint_flags", "llamacpp_arch", "metrics", "parse_metrics",
    "plain_server_config", "read_gguf_metadata", "reads_export", "require_server", "require_tree", "run_converter", "server_args",
    "server_build", "serving_md", "source_dir", "spec_flags", "target_architecture", "target_gguf", "to_boundaries",
    "to_ids", "unpack_tree", "refusal",
]

from eaglewire.engines.llamacpp.runtime import RUNTIME  # noqa: E402
from eaglewire.engines.llamacpp.served import REEXPORT_FIX  # noqa: E402
from eaglewire.engines.llamacpp.server import served_version  # noqa: E402


def _flags_label(n_max: int, p_min: float, n_min: int, block: bool) -> str:
    return (("--spec-type draft-dflash " if block else "") + f"--spec-draft-n-max {n_max} --spec-draft-n-min {n_min} "
            f"--spec-draft-p-min {p_min:g}")


# common/speculative.cpp: each drafted token is kept while its top-10 renormalised probability reaches p-min
CHAIN_RULE = ChainRule(token_stop=True, block_stops=True, label=_flags_label)


def doctor_fields(*args, **kwargs):
    """The doctor's reading of every field a draft GGUF makes llama.cpp compute with (engines/llamacpp/served.py)."""
    from eaglewire.engines.llamacpp.served import read_fields

    return read_fields(*args, **kwargs)


def judged(served: str | None) -> tuple[str, str]:
    """Which build's reading judges a llama-server of build ``served``."""
    pinned = f"b{BUILD}" if not str(BUILD).startswith("b") else str(BUILD)
    if served == pinned:
        return f"llama.cpp {pinned}", f"judged with llama.cpp {pinned}'s reading (the server says {served})"
    return f"llama.cpp {pinned}", (f"judged with llama.cpp {pinned}'s reading, the one eaglewire has; the server says "
            f"{served or 'no build (no /props)'}: another build may read the GGUF otherwise")


SPEC = EngineSpec(
    name=NAME, version=f"b{BUILD}", measure=measure_served, runtime=RUNTIME, installer=INSTALLER, block_follows_shape=True, draft_file_suffix=".gguf", served_version=served_version, judged=judged, reads_export=reads_export, chain_rule=CHAIN_RULE,
    eagle3=IdReading(to_ids=to_ids, to_boundaries=to_boundaries),
    dflash=IdReading(to_ids=dflash_to_ids, to_boundaries=dflash_to_boundaries),
    exporter=Exporter(export=export, export_dflash=export_dflash, pruned_dflash=True),
    sampling=Sampling(acceptance_rule=ACCEPTANCE_RULE, launch_temperature=launch_temperature),
    linter=Linter(lint_flags=lint_flags, lint_dflash_flags=lint_dflash_flags, launch_template_kwargs=launch_template_kwargs,
                  template_kwargs_fix=template_kwargs_fix, template_kwargs_flag=TEMPLATE_KWARGS_FLAG,
                  refusal=refusal, label="llama.cpp", default_n_max=DEFAULT_N_MAX, arch_reading=arch_reading,
                  target_file_arch=target_file_arch, draft_file_layout=draft_file_layout,
                  draft_file_vocab=draft_file_vocab, vocab_fix=VOCAB_FIX, draft_file_fix=DRAFT_FILE_FIX,
                  read_draft_file=doctor_fields, draft_file_layers=draft_file_layers, layout_fix=layout_fix,
                  field_fix=REEXPORT_FIX,
                  norm_flags=("norm_before_residual", "norm_before_fc"), d2t_reading="ids"),
)
