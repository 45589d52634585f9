"""SGLang (0.5.23): how it reads a draft's ids on each target model file, where its config keeps
them, its EAGLE-3 draft format (``LlamaForCausalLMEagle3``), its export, and its launch-flag lint.

Ids. SGLang picks the aux states in each target's model file (``set_eagle3_layers_to_capture``),
so the same ids mean other boundaries on other targets (``FILES``; tests/engines re-reads every
cited function from the released wheel):

| target model file                         | id -> boundary                     | boundaries |
|-------------------------------------------|------------------------------------|------------|
| llama (mistral), qwen2, qwen3             | b = id + 1  (id -1 -> 0)           | 0..L-1     |
| gemma3_causal                             | id + 1, but captures the block's output without the residual | 0 only |
| deepseek_v2 (DeepSeek-V3), glm4_moe_lite  | b = id + 1 if ids[0] == 1 else id  | 0..L-1, not starting at 1 |
| gpt_oss                                   | b = id if max(id) == L else id + 1 | 0..L       |

Config. The EAGLE reference layout plus ``target_hidden_size`` and the nested
``eagle_config.eagle_aux_hidden_state_layer_ids``, the only place SGLang reads ids from
(model_runner_components/spec_aux_hidden_state.py; a missing or broken config falls back to
boundaries ``[2, L//2, L-3]`` without error). SGLang sizes ``fc`` from ``num_aux_hidden_states``,
else from the nested id list, else 3 (models/llama_eagle3.py); it uses ``d2t`` (as
``hot_token_id``), ignores ``t2d`` and shares the target's embedding. Tensor names are
eaglewire's native names.

An eaglewire export also writes the boundaries as the top-level
``eagle_aux_hidden_state_layer_ids``: SGLang never looks there, and vLLM looks there first,
so vLLM loading the SGLang export captures the same boundaries.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eaglewire.model.checkpoint import DraftFiles
from eaglewire.core.contract import TARGET_ARCHS, ContractError, EngineConventionError, target_arch, validate_boundaries
from eaglewire.model.draft import DraftConfig
import eaglewire.engines.formats.model_file as model_file
from eaglewire.engines.export import (ExportConfig, ExportReport, OtherReadings, default_target_arch, finish,
                                      record, serving_dtype, verifier, write_export)
from eaglewire.engines.serving.launch_flags import Flags, as_int, chain_shape, parse_flags, resolve_abbreviation
from eaglewire.engines.formats.model_file import ModelFile
from eaglewire.engines.serving.sampling_defaults import Temperature, generation_config_temperature
from eaglewire.engines.formats.eagle3_layout import ARCHITECTURE, eagle_config_ids, llama_layer_config, parse_eagle3_config

log = logging.getLogger(__name__)


NAME = "sglang"
VERSION = "0.5.23"  # the release these readings were taken from (tests/engines re-reads them)
PER_MODEL_FILE = True  # the ids' meaning depends on the target's model file
NEEDS_TARGET_ARCH = True  # so no reading without the target's architecture


def _file(path: str, cls: str, ids: str = "plus_one", *, last: bool = False, block_output: bool = False) -> ModelFile:
    return ModelFile(engine="sglang", path=f"sglang/srt/models/{path}", ids=ids, captures_last=last,
                     function=f"{cls}.set_eagle3_layers_to_capture", block_output=block_output)


FILES: dict[str, ModelFile] = {
    "llama": _file("llama.py", "LlamaForCausalLM"),
    "mistral": _file("llama.py", "LlamaForCausalLM"),  # models/mistral.py subclasses it
    "qwen2": _file("qwen2.py", "Qwen2ForCausalLM"),
    "qwen3": _file("qwen3.py", "Qwen3ForCausalLM"),
    "gemma3": _file("gemma3_causal.py", "Gemma3ForCausalLM", last=True, block_output=True),
    "deepseek_v3": _file("deepseek_v2.py", "DeepseekV2ForCausalLM", "plus_one_if_first_is_one"),
    "glm4_moe_lite": _file("glm4_moe_lite.py", "Glm4MoeLiteForCausalLM", "plus_one_if_first_is_one"),
    "gpt_oss": _file("gpt_oss.py", "GptOssForCausalLM", "verbatim_if_max_is_L", last=True),
}

_MODELS = "sglang/srt/models/"
_NO_CAPTURE = ("SGLang {v}'s {cls} ({path}) has no set_eagle3_layers_to_capture, so SGLang refuses an EAGLE-3 "
               "draft for this target (model_executor/model_runner_components/attention_backend_setup.py "
               "configure_aux_hidden_state_capture raises)")  # the alternatives: registry.served_elsewhere
# *ForConditionalGeneration targets: the wrapper's file, and whether its set_eagle3_layers_to_capture hands
# the ids to its language model (whose rule then applies)
WRAPPER_FILES: dict[str, ModelFile] = {
    "gemma3forconditionalgeneration": model_file.wrapped(
        FILES["gemma3"], _MODELS + "gemma3_mm.py",
        "Gemma3ForConditionalGeneration.set_eagle3_layers_to_capture -> language_model", forwards=True),
    "llavaforconditionalgeneration": model_file.wrapped(
        FILES["llama"], _MODELS + "llava.py", "LlavaForConditionalGeneration", forwards=False,
        why=_NO_CAPTURE.format(v=VERSION, cls="LlavaForConditionalGeneration", path="models/llava.py")),
    "mistral3forconditionalgeneration": model_file.wrapped(
        FILES["mistral"], _MODELS + "mistral.py", "Mistral3ForConditionalGeneration(LlavaForConditionalGeneration)",
        forwards=False, why=_NO_CAPTURE.format(v=VERSION, cls="Mistral3ForConditionalGeneration",
                                               path="models/mistral.py")),
    "qwen2vlforconditionalgeneration": model_file.wrapped(
        FILES["qwen2"], _MODELS + "qwen2_vl.py", "Qwen2VLForConditionalGeneration", forwards=False,
        why=_NO_CAPTURE.format(v=VERSION, cls="Qwen2VLForConditionalGeneration", path="models/qwen2_vl.py")),
    "qwen2_5_vlforconditionalgeneration": model_file.wrapped(
        FILES["qwen2"], _MODELS + "qwen2_5_vl.py",
        "Qwen2_5_VLForConditionalGeneration.set_eagle3_layers_to_capture (self.model: Qwen2Model)", forwards=True),
}


# ---------------------------------------------------------------- ids

def file_for(arch: str | None) -> ModelFile:
    """The model file whose rule SGLang applies to a target of architecture ``arch``."""
    if arch is None:
        raise ContractError(
            f"SGLang {VERSION} reads the ids differently per target model file; give the "
            f"target's architecture (target_arch / --target-arch: {', '.join(TARGET_ARCHS)})")
    wrapper = model_file.wrapper_key(arch)
    return WRAPPER_FILES[wrapper] if wrapper else FILES[target_arch(arch)]


def refusal(arch: str | None) -> str | None:
    """Why SGLang serves no EAGLE-3 draft on this target at all (None: it does)."""
    return None if arch is None else file_for(arch).unsupported


def layers_to_capture(ids: list[int], rule: str, num_layers: int) -> list[int]:
    """The ``layers_to_capture`` SGLang's ``set_eagle3_layers_to_capture`` sets for ``ids`` under ``rule``."""
    return model_file.layers_to_capture(ids, rule, num_layers)


def to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    """The ids that make SGLang's model file for ``arch`` capture exactly ``boundaries``."""
    f = file_for(arch)
    if f.unsupported:
        raise EngineConventionError(f.unsupported)
    where = f"SGLang {VERSION}'s {f.path} ({f.function})"
    instead = "Retrain on another layout (e.g. [2, L//2, L-3]), or serve with vLLM or eaglewire"
    if f.block_output and any(b > 0 for b in boundaries):
        raise EngineConventionError(
            f"{where} captures, for every layer after the first, the previous block's output without the "
            "residual (the layer returns them apart and only hidden_states is kept), not the residual-stream "
            "boundary the draft was trained on: SGLang would feed this Gemma 3 target's draft other states. "
            "Serve it with eaglewire")
    if num_layers in boundaries and not f.captures_last:
        raise EngineConventionError(
            f"{where} cannot capture boundary {num_layers} (the last layer's pre-norm output of a "
            f"{num_layers}-layer target): its id would ask for the input of layer {num_layers}, which does "
            f"not exist, so the draft would get fewer states than its fc takes. {instead}")
    if f.ids == "plus_one":
        ids = [b - 1 for b in boundaries]
    elif f.ids == "plus_one_if_first_is_one":
        if boundaries[0] == 1:
            raise EngineConventionError(
                f"{where} adds 1 to the ids only when the first id is 1: a first id 0 means boundary 0 and a "
                f"first id 1 means boundary 2, so no id list starts at boundary 1. {instead}")
        ids = [b - 1 for b in boundaries] if boundaries[0] == 2 else list(boundaries)
    elif f.ids == "verbatim_if_max_is_L":
        ids = list(boundaries) if boundaries[-1] == num_layers else [b - 1 for b in boundaries]
    else:
        raise ContractError(f"unknown SGLang id rule {f.ids!r}")
    assert model_file.read(ids, num_layers, f) == boundaries, (ids, boundaries, f)
    return ids


def to_boundaries(ids: list[int], num_layers: int, arch: str | None) -> list[int]:
    """Boundaries SGLang's model file for ``arch`` captures for config ``ids``, in the order fed."""
    return model_file.read_every(ids, num_layers, file_for(arch), f"SGLang {VERSION}")


def families() -> dict[str, list[str]]:
    """Target families whose SGLang model files read ids alike: ``"llama/mistral/..."`` -> archs."""
    groups: dict[tuple[str, bool, bool], list[str]] = {}
    for arch, f in FILES.items():
        groups.setdefault((f.ids, f.captures_last, f.block_output), []).append(arch)
    return {"/".join(archs): archs for archs in groups.values()}


def readings_by_file(ids: list[int], num_layers: int) -> dict[str, list[int] | str]:
    """How SGLang reads ``ids`` on each target family: label -> boundaries captured, or why
    it cannot (families whose model files agree share one label)."""
    out: dict[str, list[int] | str] = {}
    for family, archs in families().items():
        label = f"sglang {VERSION} on {family} targets"
        try:
            out[label] = validate_boundaries(to_boundaries(ids, num_layers, archs[0]), num_layers)
        except ContractError as e:
            out[label] = str(e)
        got = out[label]
        if FILES[archs[0]].block_output and isinstance(got, list) and max(got) > 0:
            out[label] = (f"the inputs of layers {got}, but as the previous block's output without the "
                          f"residual, not the residual-stream boundaries ({FILES[archs[0]].path})")
    return out


def ambiguity(boundaries: list[int], ids: list[int], num_layers: int) -> str | None:
    """A sentence naming the target families on which SGLang reads ``ids`` as other than
    ``boundaries`` (None if all read them alike; Gemma 3, wrong for any ids, is left out)."""
    found = {k: v for k, v in readings_by_file(ids, num_layers).items() if "gemma3" not in k}
    wrong = {k: v for k, v in found.items() if v != list(boundaries)}
    if not wrong:
        return None
    return (f"On other targets SGLang reads ids {list(ids)} differently: "
            + "; ".join(f"{k}: {v if isinstance(v, str) else f'boundaries {v}'}" for k, v in wrong.items()) + ".")


def read_notes(ids: list[int], boundaries: list[int], num_layers: int, arch: str | None) -> list[str]:
    """What an import states about reading ``ids`` as ``boundaries`` on this target."""
    f = file_for(arch)
    amb = ambiguity(boundaries, ids, num_layers)
    return [f"read ids {ids} as boundaries {boundaries} with the rule of {f.path} ({model_file.wrapper_key(arch) or target_arch(arch)} "
            f"target){'; ' + amb if amb else ''}"]


def cannot_feed(declared: list[int], num_layers: int, arch: str | None) -> str:
    """Why SGLang cannot capture ``declared`` on this target ('' if it can)."""
    return model_file.why_not(to_ids, declared, num_layers, arch)


def config_fix(declared: list[int], num_layers: int, arch: str | None) -> str:
    """The exact config change that makes SGLang capture ``declared`` on this target."""
    try:
        if arch is not None:
            ids = to_ids(declared, num_layers, arch)
            return (f'set "eagle_config": {{"eagle_aux_hidden_state_layer_ids": {json.dumps(ids)}}} (the rule '
                    f"of {file_for(arch).path}), or re-export with `eaglewire export --to sglang`")
    except EngineConventionError as e:
        return str(e)
    options = []
    for family, archs in families().items():
        try:
            options.append(f"{json.dumps(to_ids(declared, num_layers, archs[0]))} on {family} targets")
        except EngineConventionError:
            options.append(f"none on {family} targets")
    return ("set eagle_config.eagle_aux_hidden_state_layer_ids to " + "; ".join(options)
            + " (or re-export with `eaglewire export --to sglang`, which reads the target's architecture)")


# ---------------------------------------------------------------- config and format

def build_config(cfg: DraftConfig, ids: list[int], boundaries: list[int] | None = None, *,
                 dtype: str | None = None) -> dict[str, Any]:
    """config.json of a SGLang draft: ``ids`` in SGLang's convention for the target's model
    file (nested); ``boundaries`` for vLLM (top level) and the dtype engines should run it
    in, when given (an eaglewire export gives both; SpecForge writes neither)."""
    config = {
        "architectures": [ARCHITECTURE],
        **llama_layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
    }
    if dtype is not None:
        config["torch_dtype"] = dtype
    if boundaries is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(boundaries)
    return config


def num_aux(d: dict[str, Any]) -> int:
    """How many aux states SGLang sizes ``fc`` for (models/llama_eagle3.py)."""
    if d.get("num_aux_hidden_states") is not None:
        return int(d["num_aux_hidden_states"])
    nested = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def parse_config(d: dict[str, Any], *, where: str = "config.json"
                 ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, ids or None, notes) of a SGLang draft directory."""
    return parse_eagle3_config(d, where=where, reader="SGLang")


def read_ids(config: dict[str, Any]) -> tuple[dict[str, list[int] | None], list[str]]:
    """Where SGLang finds its aux ids in ``config``: (label -> ids, None for its default; notes)."""
    ids, notes = eagle_config_ids(config, reader="SGLang")
    return {"sglang": ids}, notes


def serving_md(*, draft_path: str, target_name: str, boundaries: list[int], ids: list[int], target_arch: str,
               model_file: str, ambiguity: str | None, num_steps: int, others: list[str]) -> str:
    """SERVING.md for a SGLang export: exact launch flags, and how other engines read the directory."""
    lines = [
        "# Serving this draft with SGLang", "",
        f"Exported by eaglewire for SGLang {VERSION} and a `{target_arch}` target, whose ids SGLang "
        f"reads in `{model_file}`. The draft reads target boundaries {boundaries}; "
        f"`eagle_config.eagle_aux_hidden_state_layer_ids` is {json.dumps(ids)}, from which that model file "
        "captures exactly those boundaries.", "",
        " ".join(["**The ids are only right for this target's model file.**", *([ambiguity] if ambiguity else []),
                  "Export again for another target; the wrong reading feeds the draft other layers without "
                  "any error."]), "",
        "Chain drafting (top-k 1; SGLang requires num-draft-tokens = num-steps + 1):", "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target_name} \\",
        "    --speculative-algorithm EAGLE3 \\",
        f"    --speculative-draft-model-path {draft_path} \\",
        f"    --speculative-num-steps {num_steps} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {num_steps + 1}",
        "```", "",
        "Tree drafting (SGLang's defaults): `--speculative-num-steps 5 --speculative-eagle-topk 4 "
        "--speculative-num-draft-tokens 8`. Add `--tp N` to shard the target over N GPUs.", "",
        f"`--model-path` must be the very target the draft was trained for ({target_name}); a "
        "requantized or fine-tuned target lowers acceptance. SGLang uses this draft's `d2t`, "
        "ignores `t2d` and shares the target's embedding; it sizes `fc` from the id list.", "",
        "Served τ against what the draft earns: `eaglewire doctor --draft DRAFT --engine sglang --engine-url "
        "http://HOST:30000` (each answer's `meta_info`; `--enable-metrics` adds SGLang's gauges).", "",
        "## Other engines loading this directory", "",
        *others, "",
    ]
    return "\n".join(lines)


def export(draft: DraftFiles, fmt: str, out: Path, config: ExportConfig, *, target=None,
           allow: frozenset[str] | set[str] = frozenset(), others: OtherReadings) -> ExportReport:
    """Write ``draft`` for SGLang into ``out``: ids by the rule of the target's model file
    (``config.target_arch``, default: the architecture the contract records);
    EngineConventionError for a layout that model file cannot capture."""
    contract = draft.contract
    bounds, L = list(contract.aux_boundaries), contract.num_layers
    arch = default_target_arch(config.target_arch, contract.target.architecture)
    ids = to_ids(bounds, L, arch)
    amb = ambiguity(bounds, ids, L)
    notes = [amb] if amb else []
    dtype = serving_dtype(draft.target_spec, contract.target.dtype, notes)
    engine_config = {**build_config(draft.draft_config, ids, bounds, dtype=dtype),
                     **record(draft, arch, f"sglang {VERSION}")}
    serving = serving_md(draft_path=str(out.resolve()), target_name=verifier(config, draft) or "<the target's path or id>",
                         boundaries=bounds, ids=ids, target_arch=arch, model_file=file_for(arch).path,
                         ambiguity=amb, num_steps=config.num_steps,
                         others=others("sglang", boundaries=bounds, ids=ids, num_layers=L, target_arch=arch))
    files = write_export(out, engine_config, draft.state(), serving)
    return finish(ExportReport(format=fmt, out_dir=out, aux_boundaries=bounds, engine_ids=ids, files=files,
                               notes=notes))


def reads_export(engine: str, *, boundaries: list[int], ids: list[int], num_layers: int,
                 target_arch: str | None) -> list[str]:
    """SERVING.md lines: how SGLang reads the directory another ``engine``'s export wrote."""
    if engine != "vllm":
        return []
    return [f"- SGLang {VERSION} cannot load it (it has no `Eagle3Speculator` architecture). Use "
            f"`eaglewire export --to sglang` instead: {_ids_note(boundaries, num_layers, target_arch)}.",
            "- Copying these ids into a SGLang config would be wrong: SGLang adds 1 to them on most target "
            "model files (engines/sglang/readings.py), one layer off."]


def _ids_note(bounds: list[int], L: int, arch: str | None) -> str:
    if arch is None:
        return "this target's architecture has no SGLang reading in eaglewire (pass --target-arch)"
    try:
        ids = to_ids(bounds, L, arch)
    except EngineConventionError as e:
        return f"SGLang cannot serve this draft on this target: {e}"
    return f"its nested ids would be {json.dumps(ids)} for this `{arch}` target"


# ---------------------------------------------------------------- launch flags

# sglang/srt/arg_groups/fields/spec.py: every --speculative-* option (read by a plain argparse parser,
# allow_abbrev on: a unique prefix abbreviates one); its aliases (Arg(aliases=...))
SPEC_FLAGS = tuple("--" + f.replace("_", "-") for f in (
    "speculative_algorithm", "speculative_draft_model_path", "speculative_draft_model_revision",
    "speculative_draft_load_format", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "speculative_dflash_block_size", "speculative_domino_candidate_pool_size", "speculative_dspark_block_size",
    "speculative_dspark_sps_table_path", "speculative_dspark_confidence_sts_path",
    "speculative_dspark_align_verify_tokens_to_graph_tier", "speculative_accept_threshold_single",
    "speculative_accept_threshold_acc", "speculative_use_rejection_sampling", "speculative_use_block_verification",
    "speculative_token_map", "speculative_attention_mode", "speculative_draft_attention_backend",
    "speculative_dsa_topk_backend", "speculative_draft_kv_cache_dtype", "speculative_draft_window_size",
    "speculative_draft_sink_size", "speculative_moe_runner_backend", "speculative_moe_a2a_backend",
    "speculative_enable_w4a4_mxfp4_megamoe", "speculative_draft_model_quantization", "speculative_adaptive",
    "speculative_adaptive_config", "speculative_ngram_min_bfs_breadth", "speculative_ngram_max_bfs_breadth",
    "speculative_ngram_match_type", "speculative_ngram_max_trie_depth", "speculative_ngram_capacity",
    "speculative_ngram_external_corpus_path", "speculative_ngram_external_sam_budget",
    "speculative_ngram_external_corpus_max_tokens"))
FLAG_ALIASES = {"--speculative-draft-model": "--speculative-draft-model-path"}


def read_flags(flags: str) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """SGLang's launch flags as its parser reads them: aliases and unique abbreviations resolved to
    the option's name; (flags, problems: an ambiguous abbreviation, or an underscore spelling argparse
    refuses)."""
    out, problems = {}, []
    for flag, value in parse_flags(flags).items():
        if flag.startswith("--speculative_"):
            problems.append(("fail", f"{flag}: SGLang's parser knows only dashes, so it refuses this flag",
                             flag.replace("_", "-")))
            continue
        got = resolve_abbreviation(flag, SPEC_FLAGS, FLAG_ALIASES) if flag.startswith("--speculative") else flag
        if isinstance(got, list):
            problems.append(("fail", f"{flag} abbreviates several SGLang options ({', '.join(got)}): argparse "
                             "refuses it", "spell the option out"))
            continue
        out[got] = value
    return out, problems


def lint_flags(flags: str, declared: list[int], num_layers: int, arch: str | None) -> Flags:
    """SGLang launch flags it would silently change or cannot honour (``arch``: the target's
    architecture, for what its model file can capture), read as its parser reads them (``read_flags``)."""
    args, problems = read_flags(flags)
    out = Flags(problems=problems, draft_path=args.get("--speculative-draft-model-path"))
    cannot = cannot_feed(declared, num_layers, arch) if arch is not None else ""
    if cannot:
        out.problems.append(("fail", f"sglang cannot feed this draft {declared} on this target", cannot))
    algo = args.get("--speculative-algorithm")
    if algo is None:
        out.problems.append(("fail", "no --speculative-algorithm: SGLang serves without speculation (server_args.py: "
                             "speculative_algorithm defaults to None; the draft flags are ignored)",
                             "--speculative-algorithm EAGLE3"))
    elif algo.upper() != "EAGLE3":
        out.problems.append(("fail", f"--speculative-algorithm {algo}: SGLang will not feed aux states "
                             "to an EAGLE-3 draft", "--speculative-algorithm EAGLE3"))
    return chain_shape(args, out, verdict="warn", silently="SGLang overrides it with only a log warning")


# ---------------------------------------------------------------- DFlash (--speculative-algorithm DFLASH)
# SGLang 0.5.23 loads z-lab's layout (models/dflash.py DFlashDraftModel). Its ids:
# speculative/dflash_utils.py parse_dflash_draft_config reads ``dflash_config.target_layer_ids`` (else a top-level
# ``target_layer_ids``; neither: build_target_layer_ids(L, draft layers)); DFlashDraftConfig.resolve_target_layer_ids
# refuses an id outside [0, L). model_runner_components/attention_backend_setup.py configure_aux_hidden_state_capture
# hands them to the target model file's set_dflash_layers_to_capture (a file without one raises), which sets
# ``layers_to_capture = [val + 1 for val in layer_ids]`` ("captures before layer i"): boundary = id + 1, boundary
# L only where the forward captures after the last layer (gpt_oss.py). tests/engines re-reads every cited body.
DFLASH_FUNCTION = "set_dflash_layers_to_capture"
_NO_DFLASH = ("SGLang {v}'s {path} has no set_dflash_layers_to_capture, so SGLang refuses a DFlash draft for this "
              "target (attention_backend_setup.py configure_aux_hidden_state_capture raises); serve it with vLLM or "
              "eaglewire")


def _dflash_file(arch: str, *, supported: bool = True) -> ModelFile:
    f = FILES[arch]
    return ModelFile(engine="sglang", path=f.path, ids="plus_one", captures_last=f.captures_last,
                     function=f.function.replace("set_eagle3_layers_to_capture", DFLASH_FUNCTION),
                     unsupported=None if supported else _NO_DFLASH.format(v=VERSION, path=f.path))


DFLASH_FILES: dict[str, ModelFile] = {
    arch: _dflash_file(arch, supported=arch not in ("qwen2", "gemma3")) for arch in FILES}


def dflash_file_for(arch: str | None) -> ModelFile:
    if arch is None:
        raise ContractError(f"SGLang {VERSION} reads DFlash ids per target model file; give the target's "
                            f"architecture (target_arch / --target-arch: {', '.join(TARGET_ARCHS)})")
    if model_file.wrapper_key(arch):
        raise EngineConventionError(f"eaglewire has not read SGLang {VERSION}'s DFlash capture for the wrapped "
                                    f"target {arch}; serve it with vLLM or eaglewire")
    return DFLASH_FILES[target_arch(arch)]


def dflash_to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    """``dflash_config.target_layer_ids`` that make SGLang's model file for ``arch`` capture ``boundaries``."""
    f = dflash_file_for(arch)
    if f.unsupported:
        raise EngineConventionError(f.unsupported)
    where = f"SGLang {VERSION}'s {f.path} ({f.function})"
    if 0 in boundaries:
        raise EngineConventionError(f"{where} captures boundary id + 1, so boundary 0 needs id -1, which "
                                    "DFlashDraftConfig.resolve_target_layer_ids refuses. Retrain without boundary 0, "
                                    "or serve with vLLM or eaglewire")
    if num_layers in boundaries and not f.captures_last:
        raise EngineConventionError(f"{where} cannot capture boundary {num_layers}: its forward captures layer "
                                    "inputs only. Retrain without it, or serve with vLLM or eaglewire")
    return [b - 1 for b in boundaries]


def dflash_to_boundaries(ids: list[int], num_layers: int, arch: str | None) -> list[int]:
    """Boundaries SGLang's model file for ``arch`` captures for DFlash ``ids``, in the order fed."""
    f = dflash_file_for(arch)
    if f.unsupported:
        raise EngineConventionError(f.unsupported)
    bad = [i for i in ids if i < 0 or i >= num_layers]
    if bad:
        raise EngineConventionError(f"SGLang {VERSION} refuses DFlash target_layer_ids {bad} outside [0, {num_layers}) "
                                    "(dflash_utils.py resolve_target_layer_ids)")
    return model_file.read_every(ids, num_layers, f, f"SGLang {VERSION}")


def read_dflash_ids(config: dict[str, Any]) -> tuple[dict[str, list[int] | None], list[str]]:
    """Where SGLang finds DFlash ids: ``dflash_config.target_layer_ids``, else the top-level ``target_layer_ids``
    (None: its build_target_layer_ids default)."""
    nested = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if nested.get("target_layer_ids") is not None:
        return {f"sglang {VERSION} dflash_config.target_layer_ids": list(nested["target_layer_ids"])}, []
    if config.get("target_layer_ids") is not None:
        return {f"sglang {VERSION} target_layer_ids": list(config["target_layer_ids"])}, []
    notes = []
    if config.get("speculators_model_type") == "dflash":
        notes.append(f"a speculators DFlash config: SGLang {VERSION} has no DFlashSpeculator model and cannot load it")
    return {f"sglang {VERSION} dflash_config.target_layer_ids": None}, notes


def dflash_config_fix(declared: list[int], num_layers: int, arch: str | None, config: dict[str, Any]) -> str:
    written = ((config.get("dflash_config") or {}).get("target_layer_ids")
               if isinstance(config.get("dflash_config"), dict) else None)
    try:
        want = dflash_to_ids(declared, num_layers, arch)
    except (EngineConventionError, ContractError) as e:
        return str(e)
    return (f"dflash_config.target_layer_ids is {json.dumps(written)}; write \"dflash_config\": "
            f'{{"target_layer_ids": {json.dumps(want)}}} (the rule of {dflash_file_for(arch).path}: boundary = id + 1), '
            "or re-export with `eaglewire export --to sglang`")


# sglang/srt/arg_groups/speculative_hook.py _handle_dflash (0.5.23): --speculative-draft-model-path required;
# --speculative-num-steps and --speculative-eagle-topk other than 1 overridden to 1 with a log warning;
# --speculative-dflash-block-size and --speculative-num-draft-tokens must match (else ValueError); the verify
# window is --speculative-num-draft-tokens, else the draft config's block_size, else 16. dflash_worker_v2.py
# runs blocks of that size and only logs "DFLASH block size mismatch" when it is not the draft's block_size.
def lint_dflash_flags(flags: str, declared: list[int], num_layers: int, arch: str | None, block_size: int) -> Flags:
    """SGLang launch flags for a DFlash draft trained with blocks of ``block_size``: what SGLang refuses, what it
    overrides with a log warning, and the block it would draft (``Flags.num_steps``: drafted tokens per round)."""
    args, problems = read_flags(flags)
    out = Flags(problems=problems, draft_path=args.get("--speculative-draft-model-path"))
    cannot = model_file.why_not(dflash_to_ids, declared, num_layers, arch) if arch is not None else ""
    if cannot:
        out.problems.append(("fail", f"sglang cannot feed this DFlash draft {declared} on this target", cannot))
    algo = args.get("--speculative-algorithm")
    if algo is None or algo.upper() != "DFLASH":
        out.problems.append(("fail", f"--speculative-algorithm {algo or '(not given)'}: SGLang will not run the "
                             "draft as a DFlash block draft", "--speculative-algorithm DFLASH"))
    if "--speculative-draft-model-path" not in args:
        out.problems.append(("fail", "no --speculative-draft-model-path: SGLang refuses DFLASH without it",
                             "--speculative-draft-model-path DRAFT_DIR"))
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk"):
        value = as_int(args.get(flag))
        if value is not None and value != 1:
            out.problems.append(("warn", f"{flag} {value}: DFLASH overrides it to 1 with only a log warning "
                                 "(a block is drafted in one pass, as a chain)", f"drop {flag}"))
    tokens = as_int(args.get("--speculative-num-draft-tokens"))
    block = as_int(args.get("--speculative-dflash-block-size"))
    if tokens is not None and block is not None and tokens != block:
        out.problems.append(("fail", f"--speculative-num-draft-tokens {tokens} and --speculative-dflash-block-size "
                             f"{block} differ: SGLang refuses to start", f"--speculative-num-draft-tokens {block_size}"))
    window = block if block is not None else tokens if tokens is not None else block_size
    if window != block_size and (tokens is None or block is None or tokens == block):  # else it never starts
        out.problems.append(("warn", f"SGLang verifies blocks of {window}, the draft was trained on blocks of "
                             f"{block_size}: it only logs \"DFLASH block size mismatch\"" +
                             (" (positions past the trained block are drafted untrained)" if window > block_size else ""),
                             f"--speculative-num-draft-tokens {block_size} (or leave it out: SGLang reads the "
                             "draft's block_size)"))
    out.num_steps, out.topk, out.num_draft_tokens = window - 1, 1, window
    return out


def export_dflash(draft: DraftFiles, fmt: str, out: Path, config: ExportConfig, *, target=None,
                  allow: frozenset[str] | set[str] = frozenset(), others: OtherReadings | None = None) -> ExportReport:
    """Write a DFlash ``draft`` in z-lab's layout with the ids of the target's SGLang model file."""
    from eaglewire.engines.formats.dflash_layout import zlab_config

    contract = draft.contract
    bounds, L = list(contract.aux_boundaries), contract.num_layers
    arch = default_target_arch(config.target_arch, contract.target.architecture)
    ids = dflash_to_ids(bounds, L, arch)
    notes: list[str] = []
    dtype = serving_dtype(draft.target_spec, contract.target.dtype, notes)
    engine_config = {**zlab_config(draft.draft_config, ids, num_target_layers=L, dtype=dtype),
                     **record(draft, arch, f"sglang {VERSION}")}
    bs = draft.draft_config.block_size
    target_name = verifier(config, draft) or "<the target's path or id>"
    serving = "\n".join([
        "# Serving this DFlash draft with SGLang", "",
        f"z-lab's DFlash layout, for SGLang {VERSION}. The draft reads target boundaries {bounds}; SGLang's "
        f"{dflash_file_for(arch).path} ({DFLASH_FUNCTION}) captures boundary id + 1, so "
        f"`dflash_config.target_layer_ids` are {json.dumps(ids)} (z-lab's own convention too).", "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target_name} \\",
        f"    --speculative-algorithm DFLASH --speculative-draft-model-path {out.resolve()} \\",
        f"    --speculative-dflash-block-size {bs}",
        "```", "",
        "One draft pass drafts a block of block_size - 1 tokens. The draft uses the target's embedding and "
        "lm_head (none are stored).", "",
        "## Other engines loading this directory", "",
        "- vLLM loads this layout too (`method: dflash`) and captures dflash_config.target_layer_ids + 1: "
        "the same boundaries.",
        "- llama.cpp's converter reads it (`eaglewire export --to llamacpp` runs it and checks the GGUF).", ""])
    files = write_export(out, engine_config, draft.state(), serving)
    return finish(ExportReport(format=fmt, out_dir=out, aux_boundaries=bounds, engine_ids=ids, files=files,
                               notes=notes))


# ---------------------------------------------------------------- the chat template's switches at launch

TEMPLATE_KWARGS_FLAG = "--default-chat-template-kwargs"  # sglang/srt/arg_groups/fields/serving.py


def launch_template_kwargs(flags: str) -> dict[str, Any] | None:
    """The chat-template kwargs SGLang 0.5.23 renders every chat request with by default
    (``--default-chat-template-kwargs JSON``: sglang/srt/arg_groups/fields/serving.py, ``json.loads``; a
    request's own ``chat_template_kwargs`` take precedence: sglang/srt/entrypoints/openai/serving_chat.py
    ``setdefault``); None when the flags set none."""
    from eaglewire.engines.serving.launch_flags import template_kwargs_value

    value = parse_flags(flags).get(TEMPLATE_KWARGS_FLAG)
    return None if value is None else template_kwargs_value(TEMPLATE_KWARGS_FLAG, value)


def template_kwargs_fix(kwargs: dict[str, Any]) -> str:
    """The launch flag that makes SGLang render as ``kwargs`` says."""
    return f"{TEMPLATE_KWARGS_FLAG} '{json.dumps(kwargs, sort_keys=True)}'"


# ---------------------------------------------------------------- sampling (doctor --temperature)

ACCEPTANCE_RULE = ("SGLang 0.5.23's tree_speculative_sampling_target_only (thresholds 1.0: accepted when coin < "
                   "p_T(x))")


def launch_temperature(flags: str, target_dir: Path | None) -> Temperature | None:
    """SGLang 0.5.23: the model's generation config under ``--sampling-defaults model`` (its default;
    sglang/srt/arg_groups/fields/serving.py), for chat completions."""
    if parse_flags(flags).get("--sampling-defaults", "model") != "model":
        return None
    return generation_config_temperature(target_dir, "SGLang chat completions (--sampling-defaults model)")
