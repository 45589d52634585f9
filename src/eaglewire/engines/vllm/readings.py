"""vLLM (0.33.0) and its speculators format (speculators 0.9; ``speculators`` is an alias of this
engine): how vLLM reads a draft's ids, where its config keeps them, the format, its export and
its launch-flag lint.

Ids. vLLM takes the ids verbatim as boundaries, sorted (0 = embedding output, L = the last
layer's pre-norm output), on every target model file that implements SupportsEagle3
(``FILES``: llama, qwen2/qwen3, deepseek_v2, gpt_oss); gemma3 and glm4_moe_lite have none,
so vLLM serves no EAGLE-3 draft for them. tests/engines re-reads the cited functions.

Format. The speculators EAGLE-3 format, as speculators 0.9 writes and reads it: its layout, the norm flags
and the directory's writer are engines/formats/speculators_layout.py's (llama.cpp's converter reads the layout too);
here, how vLLM reads such a config and what its export adds (the ids, SERVING.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from eaglewire.model.checkpoint import DraftFiles
from eaglewire.core.contract import ContractError, EngineConventionError
from eaglewire.core.contract import target_arch as target_arch_key
import eaglewire.engines.formats.model_file as model_file
from eaglewire.engines.export import (ExportConfig, ExportReport, OtherReadings, default_target_arch, finish,
                                      load_export_target, record, serving_dtype, verifier, write_export)
from eaglewire.engines.serving.launch_flags import Flags, as_int, parse_flexible
from eaglewire.engines.formats.model_file import ModelFile
from eaglewire.engines.serving.sampling_defaults import Temperature, generation_config_temperature, temperature_value
from eaglewire.engines.formats.eagle3_layout import FormatError, parse_llama_layer
import eaglewire.engines.formats.speculators_layout as speculators

log = logging.getLogger(__name__)

NAME = "vllm"
FORMAT_NAME = "speculators"  # its checkpoint format's name: an alias of the engine
VERSION = "0.33.0"  # the release these readings were taken from (tests/engines re-reads them)
PER_MODEL_FILE = True  # whether it serves EAGLE-3 at all depends on the target's model file

# The other release read (engines/vllm/versions.py READINGS): vLLM 0.32.0's code reads everything these readings
# rely on as 0.33.0's does (the same files and functions, compared one by one; tests/engines/test_vllm_versions.py
# re-reads them from its wheel); only these cited definitions live elsewhere in it, doing the same.
CITED_BY_VERSION: dict[str, dict[str, str]] = {
    "0.33.0": {
        "template kwargs": "vllm/entrypoints/common/cli_args.py FrontendArgs.default_chat_template_kwargs",
        "aux capture (V2 runner)": "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py requires_aux_hidden_states",
    },
    "0.32.0": {
        "template kwargs": "vllm/entrypoints/launchers/cli_args.py FrontendArgs.default_chat_template_kwargs",
        "aux capture (V2 runner)": "vllm/v1/worker/gpu/model_runner.py GPUModelRunner.__init__ "
                                   "(speculative_config.method in eagle3, dflash, dspark, extract_hidden_states)",
    },
}


def _file(path: str, model: str, *, unsupported: str | None = None) -> ModelFile:
    return ModelFile(engine="vllm", path=f"vllm/model_executor/models/{path}", ids="verbatim",
                     captures_last=unsupported is None, unsupported=unsupported,
                     function=f"{model}.forward + EagleModelMixin._set_aux_hidden_state_layers (sorted)")


# (which engines serve it instead: registry.served_elsewhere, said where the refusal reaches the user)
_NO_EAGLE3 = ("vLLM {v}'s {cls} does not implement SupportsEagle3, so vLLM refuses an EAGLE-3 draft "
              "for this target")
FILES: dict[str, ModelFile] = {
    "llama": _file("llama.py", "LlamaModel"),
    "mistral": _file("llama.py", "LlamaModel"),  # models/mistral.py subclasses LlamaForCausalLM
    "qwen2": _file("qwen2.py", "Qwen2Model"),
    "qwen3": _file("qwen2.py", "Qwen2Model"),  # Qwen3Model subclasses Qwen2Model
    "gemma3": _file("gemma3.py", "Gemma3Model", unsupported=_NO_EAGLE3.format(
        v=VERSION, cls="Gemma3ForCausalLM (models/gemma3.py)")),
    "deepseek_v3": _file("deepseek_v2.py", "DeepseekV2Model"),
    "glm4_moe_lite": _file("glm4_moe_lite.py", "Glm4MoeLiteModel", unsupported=_NO_EAGLE3.format(
        v=VERSION, cls="Glm4MoeLiteForCausalLM (models/glm4_moe_lite.py)")),
    "gpt_oss": _file("gpt_oss.py", "GptOssModel"),
}
_GENERIC = _file("llama.py", "LlamaModel")

_MODELS = "vllm/model_executor/models/"
_FORWARDS = "SupportsEagle3.set_aux_hidden_state_layers (interfaces.py): get_language_model().model"
# *ForConditionalGeneration targets (registry.py _MULTIMODAL_MODELS): the wrapper's file, and whether its
# class implements SupportsEagle3, which hands the ids to its language model's EagleModelMixin
WRAPPER_FILES: dict[str, ModelFile] = {
    "gemma3forconditionalgeneration": model_file.wrapped(
        FILES["gemma3"], _MODELS + "gemma3_mm.py", "Gemma3ForConditionalGeneration", forwards=False,
        why=_NO_EAGLE3.format(v=VERSION, cls="Gemma3ForConditionalGeneration (models/gemma3_mm.py)")),
    "llavaforconditionalgeneration": model_file.wrapped(
        FILES["llama"], _MODELS + "llava.py", f"LlavaForConditionalGeneration {_FORWARDS}", forwards=True),
    "mistral3forconditionalgeneration": model_file.wrapped(
        FILES["mistral"], _MODELS + "mistral3.py", f"Mistral3ForConditionalGeneration {_FORWARDS}", forwards=True),
    "qwen2vlforconditionalgeneration": model_file.wrapped(
        FILES["qwen2"], _MODELS + "qwen2_vl.py", "Qwen2VLForConditionalGeneration", forwards=False,
        why=_NO_EAGLE3.format(v=VERSION, cls="Qwen2VLForConditionalGeneration (models/qwen2_vl.py)")),
    "qwen2_5_vlforconditionalgeneration": model_file.wrapped(
        FILES["qwen2"], _MODELS + "qwen2_5_vl.py", f"Qwen2_5_VLForConditionalGeneration {_FORWARDS}",
        forwards=True),
}


# ---------------------------------------------------------------- ids

def file_for(arch: str | None) -> ModelFile:
    """The model file whose rule vLLM applies to a target of architecture ``arch`` (None: the
    reading every file that serves EAGLE-3 shares); a wrapped target's is its wrapper's file."""
    if arch is None:
        return _GENERIC
    wrapper = model_file.wrapper_key(arch)
    return WRAPPER_FILES[wrapper] if wrapper else FILES[target_arch_key(arch)]


def refusal(arch: str | None) -> str | None:
    """Why vLLM serves no EAGLE-3 draft on this target at all (None: it does)."""
    return None if arch is None else file_for(arch).unsupported


def to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    """vLLM's ids for ``boundaries``: the boundaries verbatim; EngineConventionError where its
    model file for ``arch`` serves no EAGLE-3 draft."""
    why = refusal(arch)
    if why:
        raise EngineConventionError(why)
    return list(boundaries)


def to_boundaries(ids: list[int], num_layers: int, arch: str | None) -> list[int]:
    """Boundaries vLLM captures for config ``ids`` (sorted, the order it feeds them)."""
    return model_file.read_every(ids, num_layers, file_for(arch), f"vLLM {VERSION}")


def read_notes(ids: list[int], boundaries: list[int], num_layers: int, arch: str | None) -> list[str]:
    """What an import states about reading ``ids`` as ``boundaries``."""
    return [f"vLLM sorts the ids: {ids} feeds boundaries {boundaries} in that order"] if list(ids) != boundaries else []


def cannot_feed(declared: list[int], num_layers: int, arch: str | None) -> str:
    """Why vLLM cannot capture ``declared`` on this target ('' if it can)."""
    return model_file.why_not(to_ids, declared, num_layers, arch)


def config_fix(declared: list[int], num_layers: int, arch: str | None) -> str:
    """The exact config change that makes vLLM capture ``declared`` on this target."""
    why = cannot_feed(declared, num_layers, arch)
    if why:
        return why
    return (f'set the top-level "eagle_aux_hidden_state_layer_ids": {json.dumps(declared)} and '
            f"transformer_layer_config.num_aux_hidden_states: {len(declared)} (or re-export with "
            "`eaglewire export --to vllm`)")


# ---------------------------------------------------------------- config and format

def parse_config(d: dict[str, Any], *, where: str = "config.json"
                 ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(layer fields + draft_vocab_size/target_hidden_size, ids or None, notes).

    Raises FormatError for anything an eaglewire draft cannot compute exactly (other norm
    placements, another layer type, another speculator type).
    """
    kind = d.get("speculators_model_type")
    if kind != speculators.MODEL_TYPE:
        hint = ("it has no speculators_model_type (a SGLang/SpecForge config? use --from sglang or specforge)"
                if kind is None else f"it is a speculators {kind!r} checkpoint")
        raise FormatError(f"{where} is not a speculators EAGLE-3 config: {hint}")
    layer_cfg = d.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise FormatError(f"{where}: transformer_layer_config is missing or not an object")
    notes = []
    for flag, (ours, meaning) in speculators.NORM_FLAGS.items():
        value = d.get(flag)
        if value is None:
            if flag == "norm_before_residual":
                notes.append("norm_before_residual is missing: read as false (speculators' default), "
                             "but vLLM reads a missing flag as true; set it explicitly before serving")
        elif bool(value) != ours:
            raise FormatError(f"{where}: {flag} is {value}: {meaning}; an eaglewire draft cannot "
                              "compute that exactly, so it cannot be imported")
    # speculators reads a layer config without model_type as Qwen3
    layer = parse_llama_layer({"model_type": "qwen3", **layer_cfg}, where=f"{where} transformer_layer_config")
    try:
        readings = id_readings(d)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from e
    ids = next(iter(readings.values()))  # a speculators config keeps them at the top level: one reading
    fc_states = num_aux(d)
    if ids is not None and fc_states != len(ids):
        notes.append(f"vLLM sizes fc for {fc_states} aux states (num_aux_hidden_states in "
                     f"transformer_layer_config, else 3) but the config names {len(ids)} ids; vLLM cannot "
                     "load it until transformer_layer_config.num_aux_hidden_states is set")
    extra = {"draft_vocab_size": d.get("draft_vocab_size"), "target_hidden_size": d.get("target_hidden_size")}
    return {**layer, **extra}, ids, notes


def read_ids(d: dict[str, Any]) -> tuple[dict[str, list[int] | None], list[str]]:
    """Where vLLM finds its aux ids in ``config``: (label -> ids, None for its default; notes)."""
    return id_readings(d), []


def id_readings(d: dict[str, Any]) -> dict[str, list[int] | None]:
    """Where vLLM 0.33.0 finds the ids in any draft config: label -> ids (None: its default).

    Both runners read the top-level ids first. Without them, the default V2 runner
    (v1/worker/gpu/spec_decode/eagle/eagle3_utils.get_eagle3_aux_layers_from_config) reads
    ``eagle_config.layer_ids`` and the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``;
    gpu_model_runner._get_eagle3_aux_layers_from_config) ``eagle_config.eagle_aux_hidden_state_layer_ids``.
    """
    top = d.get("eagle_aux_hidden_state_layer_ids")
    nested = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    v2, v1 = nested.get("layer_ids") or None, nested.get("eagle_aux_hidden_state_layer_ids") or None
    if top or v1 == v2:
        readings = {f"vllm {VERSION}": top or v2}
    else:
        readings = {f"vllm {VERSION} (V2 runner, the default)": v2, f"vllm {VERSION} (V1 runner)": v1}
    for ids in readings.values():
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
            raise FormatError(f"aux layer ids {ids!r}; expected a list of integers")
    return readings


def num_aux(d: dict[str, Any]) -> int:
    """How many aux states vLLM 0.33.0 sizes ``fc`` for (models/llama_eagle3.py): from the
    config it builds (a speculators config: ``transformer_layer_config`` only)."""
    src = d.get("transformer_layer_config") if d.get("speculators_model_type") else d
    src = src if isinstance(src, dict) else {}
    if src.get("num_aux_hidden_states") is not None:
        return int(src["num_aux_hidden_states"])
    nested = src.get("eagle_config") if isinstance(src.get("eagle_config"), dict) else {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def serving_md(*, draft_path: str, target_name: str, boundaries: list[int], num_steps: int,
               others: list[str]) -> str:
    """SERVING.md for a vLLM / speculators export: exact launch flags, and how other engines
    read the directory (``others``)."""
    spec = json.dumps({"method": "eagle3", "model": draft_path, "num_speculative_tokens": num_steps})
    return "\n".join([
        "# Serving this draft with vLLM", "",
        f"speculators EAGLE-3 format, for vLLM {VERSION}. The draft reads target boundaries {boundaries}; "
        f"vLLM takes `eagle_aux_hidden_state_layer_ids` {json.dumps(boundaries)} verbatim, sorted (0 = "
        "embedding output, L = last layer before the final norm), on every target model it serves EAGLE-3 "
        f"for, and sizes `fc` from `transformer_layer_config.num_aux_hidden_states` ({len(boundaries)}).", "",
        "```bash",
        f"vllm serve {target_name} \\",
        f"    --speculative-config '{spec}'",
        "```", "",
        "vLLM drafts chains (`num_speculative_tokens` tokens per step). Add "
        "`--tensor-parallel-size N` to shard the target over N GPUs, `--port P` for another port than 8000 (vLLM's "
        "API server reads it from no environment variable).", "",
        "On a CPU (vLLM's CPU build; `eaglewire engines install vllm` installs one): set "
        "`VLLM_CPU_KVCACHE_SPACE=GIB` (without it vLLM reserves `--gpu-memory-utilization`, 0.92, of the machine's "
        "RAM and refuses to start where less is free), `VLLM_CPU_OMP_THREADS_BIND=0-N` for the worker's threads (its "
        "default keeps a core for the scheduler), `LD_PRELOAD` tcmalloc and Intel OpenMP (`eaglewire engines which "
        "vllm` prints it; vLLM warns that speculative decoding is much slower without), and add `--enforce-eager` "
        "(torch.compile takes minutes to start on a few cores). With `--dtype auto` vLLM runs a float32 target in "
        "bfloat16; `--dtype float32` keeps the precision the draft's contract records.", "",
        f"The target must be the very one the draft was trained for ({target_name}); a requantized "
        "or fine-tuned target lowers acceptance. `embed_tokens.weight` is that target's embedding in its "
        "stored dtype, so vLLM shares the target's own (it does only when the two are exactly equal).", "",
        "Served τ against what the draft earns: `eaglewire doctor --draft DRAFT --engine vllm --engine-url "
        "http://HOST:8000` (add `--per-request-spec-decode-metrics summary` to `vllm serve`: figures of the "
        "doctor's own requests, not the counters any client moves).", "",
        "## Other engines loading this directory", "",
        *others, "",
    ])


def export_arch(config, contract) -> str | None:
    """The target architecture an export reads ids for: ``--target-arch``, else the contract's; None when the
    recorded one has no reading (vLLM reads ids verbatim on every model file that serves these drafts)."""
    try:
        return default_target_arch(config.target_arch, contract.target.architecture)
    except ContractError:
        if config.target_arch:
            raise
        return None


def export(draft: DraftFiles, fmt: str, out: Path, config: ExportConfig, *, target=None,
           allow: frozenset[str] | set[str] = frozenset(), others: OtherReadings) -> ExportReport:
    """Write ``draft`` in the speculators format into ``out`` (engines/formats/speculators_layout.py) with vLLM's ids and
    launch command. Needs the target's embedding (``target``, else loaded from the spec the draft records;
    checked against the contract, ``allow`` as in ``HiddenStateContract.check_target``)."""
    contract = draft.contract
    bounds, L = list(contract.aux_boundaries), contract.num_layers
    arch = export_arch(config, contract)
    ids = to_ids(bounds, L, arch)

    def serving(name: str | None) -> str:
        return serving_md(draft_path=str(out.resolve()), target_name=name or "<the target's path or id>",
                          boundaries=bounds, num_steps=config.num_steps,
                          others=others("vllm", boundaries=bounds, ids=ids, num_layers=L, target_arch=arch))

    files, notes = speculators.write(draft, out, config, engine=f"vllm {VERSION}", arch=arch, serving=serving,
                                     target=target, allow=allow)
    return finish(ExportReport(format=fmt, out_dir=out, aux_boundaries=bounds, engine_ids=ids, files=files,
                               notes=notes))


def reads_export(engine: str, *, boundaries: list[int], ids: list[int], num_layers: int,
                 target_arch: str | None) -> list[str]:
    """SERVING.md lines: how vLLM reads the directory another ``engine``'s export wrote."""
    if engine != "sglang":
        return []
    why = refusal(target_arch)
    if why:
        return [f"- vLLM {VERSION}: serves no EAGLE-3 draft for this target: {why}."]
    off = ("one layer off" if [i + 1 for i in ids] == boundaries else "other boundaries") if ids != boundaries \
        else "the same"
    return [f"- vLLM {VERSION}: reads the top-level `eagle_aux_hidden_state_layer_ids` {json.dumps(boundaries)} "
            "(written for it; SGLang never looks there) verbatim and captures the same boundaries. Without that key "
            f"its V1 runner would read the nested SGLang ids {json.dumps(ids)} verbatim ({off}) and its default V2 "
            "runner would fall back to [2, L//2, L-3]: do not remove it."]


# ---------------------------------------------------------------- launch flags

FLAG_ALIASES = {"-sc": "--speculative-config"}  # vllm/engine/arg_utils.py add_cli_args


def detect_method(model: str | None) -> str:
    """The method vLLM 0.33.0 takes when ``--speculative-config`` names none (vllm/config/speculative.py
    SpeculativeConfig.__post_init__: "draft_model", then detected from the draft's path: "eagle-" ->
    eagle, else "eagle3" -> eagle3, else "dflash" -> dflash)."""
    path = (model or "").lower()
    return ("eagle" if "eagle-" in path else "eagle3" if "eagle3" in path else "dflash" if "dflash" in path
            else "draft_model")


def _speculative_config(flags: str, out: Flags, method: str) -> dict | None:
    """``--speculative-config`` as vLLM's own parser reads it (``flags.parse_flexible``: ``-sc``, underscores,
    dotted keys); None, with the problem recorded in ``out``, where vLLM would run without it or refuse it."""
    args, notes = parse_flexible(flags, FLAG_ALIASES)
    raw = args.get("--speculative-config")
    if raw is None:
        out.problems.append(("fail", "no --speculative-config (nor -sc, --speculative_config or dotted "
                             "--speculative-config.KEY): vLLM runs without speculation",
                             f'--speculative-config \'{{"method": "{method}", "model": DRAFT, '
                             '"num_speculative_tokens": N}\''))
        return None
    out.problems += [("warn", n, "give --speculative-config once") for n in notes]
    try:
        spec = raw if isinstance(raw, dict) else json.loads(raw)
    except json.JSONDecodeError as e:
        out.problems.append(("fail", f"--speculative-config is not JSON ({e})", "quote the JSON object"))
        return None
    if not isinstance(spec, dict):
        out.problems.append(("fail", f"--speculative-config is {spec!r}, not a JSON object", "pass a JSON object"))
        return None
    if isinstance(spec.get("model"), str):
        out.draft_path = spec["model"]
    return spec


def _num_speculative_tokens(spec: dict, out: Flags, suggest: int) -> int | None:
    """``num_speculative_tokens`` of a speculative config, or None with a FAIL in ``out`` where vLLM
    refuses it (vllm/config/speculative.py: ``Field(default=None, gt=0)``, and "A speculative model
    was provided, but `num_speculative_tokens` was not provided" for a draft with no n_predict)."""
    raw = spec.get("num_speculative_tokens")
    n = as_int(raw)
    lax_int = n is not None and not isinstance(raw, bool) and (n == raw or str(n) == str(raw))  # 3, 3.0, "3"
    if raw is None:
        out.problems.append(("fail", "no num_speculative_tokens: vLLM refuses a draft model without it",
                             f'"num_speculative_tokens": {suggest}'))
    elif not lax_int or n < 1:
        out.problems.append(("fail", f"num_speculative_tokens {raw!r}: vLLM refuses it at launch (an integer > 0: "
                             "the tokens drafted per round)", f'"num_speculative_tokens": {suggest}'))
        return None
    return n


def lint_flags(flags: str, declared: list[int], num_layers: int, arch: str | None) -> Flags:
    """vLLM launch flags it would silently change or cannot honour (``arch``: the target's
    architecture, for whether its model file serves EAGLE-3)."""
    out = Flags()
    cannot = cannot_feed(declared, num_layers, arch) if arch is not None else ""
    if cannot:
        out.problems.append(("fail", f"vllm cannot feed this draft {declared} on this target", cannot))
    spec = _speculative_config(flags, out, "eagle3")
    if spec is None:
        return out
    method = spec.get("method")
    if method is None:
        method = detect_method(spec.get("model"))
        if method != "eagle3":
            out.problems.append(("fail", f'no "method", and vLLM detects {method!r} from the draft path '
                                 f'{spec.get("model")!r} (vllm/config/speculative.py: "eagle3" only when the path '
                                 'contains "eagle3" and not "eagle-"): it will not read the aux states',
                                 'set "method": "eagle3"'))
    elif method != "eagle3":
        out.problems.append(("fail", f"method is {method!r}: vLLM will not read the aux "
                             "states of an EAGLE-3 draft", 'set "method": "eagle3"'))
    out.num_steps = _num_speculative_tokens(spec, out, suggest=3)
    out.topk = 1
    out.num_draft_tokens = out.num_steps + 1 if out.num_steps else None
    return out


# ---------------------------------------------------------------- what the draft computes

_LLAMA_EAGLE3 = "vllm/model_executor/models/llama_eagle3.py"
SERVED_CITED = {
    "norms (speculators format)": "vllm/transformers_utils/configs/speculators/algos.py update_eagle3: "
                                  "norm_before_residual defaults to true, norm_before_fc / fc_norm / norm_output to false",
    "norms (other formats)": f"{_LLAMA_EAGLE3} LlamaDecoderLayer.__init__ getattr(config, 'norm_before_residual', False); "
                             "LlamaModel.__init__ eagle_config['norm_before_fc'] first, then the top-level key",
    "layer fields": "vllm/transformers_utils/configs/speculators/base.py extract_transformers_pre_trained_config: "
                    "the speculators format's draft config is transformer_layer_config alone (no Llama defaults)",
    "draft_vocab_size": f"{_LLAMA_EAGLE3} Eagle3LlamaForCausalLM.__init__: missing -> vocab_size (the target's)",
    "d2t / t2d": f"{_LLAMA_EAGLE3} compute_logits (targets = arange + d2t) and load_weights (t2d skipped)",
    "embedding / lm_head": "vllm/v1/worker/gpu/spec_decode/eagle/utils.py maybe_share_target_embed / _should_share: "
                           "the target's unless the checkpoint has its own that differs; the same for lm_head",
    "rope": "vllm/transformers_utils/config.py patch_rope_parameters and layers/rotary_embedding get_rope "
            "(rope_theta, else 10000)",
    "dtype": "vllm/config/speculative.py SpeculativeConfig.__post_init__: the draft's ModelConfig takes "
             "dtype=target_model_config.dtype",
    "head_dim": "vllm/model_executor/models/llama.py LlamaAttention: config.head_dim, else hidden_size // heads",
}


def read_served(d: dict[str, Any], tensors: set[str] | None = None, *, own_embedding_differs: bool = False):
    """``ServedDraft``: what vLLM 0.33.0 computes a draft with, from its ``config.json`` ``d`` as vLLM
    reads it (``SERVED_CITED``); ``tensors``: the checkpoint's tensor names, when known (its own
    lm_head / embed_tokens); ``own_embedding_differs``: its embed_tokens is not the target's exactly."""
    from eaglewire.engines.serving.served_draft import ServedDraft
    from eaglewire.engines.formats.eagle3_layout import LLAMA_DEFAULTS, parse_rope

    speculators = d.get("speculators_model_type") is not None
    if speculators:
        layer = dict(d.get("transformer_layer_config") or {})  # no Llama defaults: a bare PreTrainedConfig
        norms = {"norm_before_residual": bool(d.get("norm_before_residual", True)),
                 "norm_before_fc": bool(d.get("norm_before_fc", False)), "fc_norm": bool(d.get("fc_norm", False)),
                 "norm_output": bool(d.get("norm_output", False))}
        sections: dict[str, str] = {}
        eps = layer.get("rms_norm_eps")
        vocab_size = layer.get("vocab_size")
    else:
        layer = {**LLAMA_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}  # LlamaConfig defaults
        nested = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
        norms = {"norm_before_residual": bool(layer.get("norm_before_residual", False)),
                 "norm_before_fc": bool(nested.get("norm_before_fc", layer.get("norm_before_fc", False))),
                 "fc_norm": bool(layer.get("fc_norm", False)), "norm_output": bool(layer.get("norm_output", False))}
        eps = layer.get("rms_norm_eps")
        vocab_size = layer.get("vocab_size")
        sections = {"norm_before_fc": "eagle_config"} if "norm_before_fc" in nested else {}
    hidden, heads = layer.get("hidden_size"), layer.get("num_attention_heads")
    head_dim = layer.get("head_dim") or (int(hidden) // int(heads) if hidden and heads else None)
    theta, rope = parse_rope(layer)
    vd = d.get("draft_vocab_size") if speculators else layer.get("draft_vocab_size")
    names = tensors or set()
    own_head = tensors is None or any("lm_head" in n for n in names)
    return ServedDraft(
        engine=f"vLLM {VERSION}", norms=norms, draft_vocab_size=int(vd) if vd is not None else vocab_size,
        target_hidden_size=int(d.get("target_hidden_size") or hidden) if (d.get("target_hidden_size") or hidden) else None,
        num_aux=num_aux(d), hidden_size=int(hidden) if hidden else None, head_dim=int(head_dim) if head_dim else None,
        rms_norm_eps=float(eps) if eps is not None else None, rope_theta=theta, rope_parameters=rope,
        embedding="draft" if own_embedding_differs and any("embed_tokens" in n for n in names) else "target",
        lm_head="draft" if own_head else "target",
        layer=str(layer.get("model_type") or "llama") if speculators else "llama",
        cited=dict(SERVED_CITED), norm_sections=sections)


def served_config_key(d: dict[str, Any]) -> str:
    """Where vLLM reads the draft layer's fields in ``d`` (for fixes)."""
    return "transformer_layer_config." if d.get("speculators_model_type") is not None else ""


# ---------------------------------------------------------------- served acceptance (doctor --engine-url)
# vLLM 0.33.0's counters and per-request figures, as engines/serving/spec_decode_metrics.py reads them (eaglewire serve
# exports the same shape under its own prefix), under vLLM's prefix.

METRICS_PREFIX = "vllm:"
# Other clients' work (vllm/v1/metrics/loggers.py PrometheusStatLogger: the counter vllm:generation_tokens, the gauge
# vllm:num_requests_running; the same in 0.32.0 and 0.33.0).
TRAFFIC = ("vllm:generation_tokens_total", "vllm:num_requests_running")


def measure_served(url: str, prompts: list[list[int]], *, max_new_tokens: int, timeout: float = 900.0):
    """Greedy completions of ``prompts`` from the vLLM server at ``url`` and what it says it accepted."""
    from eaglewire.engines.serving.spec_decode_metrics import measure_served as measure

    return measure(url, prompts, max_new_tokens=max_new_tokens, timeout=timeout, prefix=METRICS_PREFIX, engine=NAME,
                   traffic_names=TRAFFIC)


# ---------------------------------------------------------------- DFlash (method "dflash")
# vLLM 0.33.0 captures a DFlash draft's states exactly as an EAGLE-3 draft's: requires_aux_hidden_states
# (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) is true for "dflash", and set_eagle3_aux_hidden_state_layers
# hands get_eagle3_aux_layers_from_config's ids to the target's SupportsEagle3.set_aux_hidden_state_layers
# (boundaries verbatim, sorted; a model without SupportsEagle3 raises). Those ids: the top-level
# ``eagle_aux_hidden_state_layer_ids``, else ``dflash_config.target_layer_ids`` + 1 ("Add 1 to convert DFlash's
# aux layer id semantics"), else (V2 runner) dspark ids, else ``dflash_config.layer_ids``. A speculators config
# (speculators_model_type "dflash") is rewritten first by transformers_utils/configs/speculators/algos.py
# update_dflash: eagle_aux_hidden_state_layer_ids := aux_hidden_state_layer_ids (required), dflash_config :=
# {target_layer_ids: aux - 1, mask_token_id, causal: not sliding_window_non_causal (default true)}.
# models/qwen3_dflash.py sizes fc for len(those ids) (else the draft's num_hidden_layers).
# (vLLM 0.32.0's V2 runner decides it in v1/worker/gpu/model_runner.py GPUModelRunner.__init__: always for
# "eagle3" and "dflash", not reading eagle_config.use_aux_hidden_state, which 0.33.0 reads for "eagle3" (default
# true); CITED_BY_VERSION. The two functions cited below are the same in 0.32.0.)
DFLASH_CITED = ("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config; "
                "vllm/transformers_utils/configs/speculators/algos.py update_dflash")


def dflash_to_ids(boundaries: list[int], num_layers: int, arch: str | None) -> list[int]:
    """The ids vLLM's runner hands the target for ``boundaries`` (speculators' ``aux_hidden_state_layer_ids``,
    which update_dflash copies verbatim): the boundaries; refused where the model file has no SupportsEagle3."""
    why = refusal(arch)
    if why:
        raise EngineConventionError(why.replace("an EAGLE-3 draft", "a DFlash draft (its aux capture is EAGLE-3's)"))
    return list(boundaries)


def dflash_to_boundaries(ids: list[int], num_layers: int, arch: str | None) -> list[int]:
    """Boundaries vLLM captures for the runner's ids (sorted, the order it feeds them)."""
    return model_file.read_every(ids, num_layers, file_for(arch), f"vLLM {VERSION}")


# vllm/config/speculative.py (0.33.0): "method" "dflash", or detected from the draft's path (detect_method);
# num_speculative_tokens required (ValueError), never compared with the draft's block_size;
# v1/spec_decode/dflash.py drafts one query of 1 + num_speculative_tokens positions (the anchor and the masks).
def lint_dflash_flags(flags: str, declared: list[int], num_layers: int, arch: str | None, block_size: int) -> Flags:
    """vLLM launch flags for a DFlash draft trained with blocks of ``block_size`` (``Flags.num_steps``: the
    tokens it drafts per round)."""
    out = Flags()
    cannot = model_file.why_not(dflash_to_ids, declared, num_layers, arch) if arch is not None else ""
    if cannot:
        out.problems.append(("fail", f"vllm cannot feed this DFlash draft {declared} on this target", cannot))
    spec = _speculative_config(flags, out, "dflash")
    if spec is None:
        return out
    method = spec.get("method") or detect_method(spec.get("model"))
    if method != "dflash":
        what = (f"method {method!r}" if spec.get("method") else
                f"no method: vLLM detects {method!r} from the draft path {spec.get('model')!r}")
        out.problems.append(("fail", f"{what}: vLLM will not run the draft as a DFlash block draft",
                             'set "method": "dflash"'))
    n = _num_speculative_tokens(spec, out, suggest=block_size - 1)
    if n is not None and n > block_size - 1:
        out.problems.append(("warn", f"num_speculative_tokens {n} > block_size - 1 = {block_size - 1}: vLLM drafts "
                             f"blocks of {n + 1} without checking, so positions past the trained block are drafted "
                             "untrained", f'"num_speculative_tokens": {block_size - 1}'))
    out.num_steps, out.topk = n, 1
    out.num_draft_tokens = n + 1 if n else None
    return out


def read_dflash_ids(d: dict[str, Any]) -> tuple[dict[str, list[int] | None], list[str]]:
    """The ids vLLM 0.33.0's runner takes from a DFlash config, as get_eagle3_aux_layers_from_config computes
    them (after update_dflash for a speculators config): label (naming the key read) -> ids, None: none found
    (its fc is then sized for the draft's num_hidden_layers and the target's default layers are captured)."""
    notes: list[str] = []
    if d.get("speculators_model_type") == "dflash":
        aux = d.get("aux_hidden_state_layer_ids")
        if aux is None:
            notes.append("aux_hidden_state_layer_ids is missing: vLLM's update_dflash requires it (KeyError at load)")
        return {f"vllm {VERSION} aux_hidden_state_layer_ids": aux}, notes
    top = d.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return {f"vllm {VERSION} eagle_aux_hidden_state_layer_ids": list(top)}, notes
    nested = d.get("dflash_config") if isinstance(d.get("dflash_config"), dict) else {}
    zlab = nested.get("target_layer_ids")
    if zlab:
        return {f"vllm {VERSION} dflash_config.target_layer_ids + 1": [int(i) + 1 for i in zlab]}, notes
    return {f"vllm {VERSION} dflash_config.layer_ids": nested.get("layer_ids") or None}, notes


def dflash_config_fix(declared: list[int], num_layers: int, arch: str | None, config: dict[str, Any]) -> str:
    """The exact key and value that make vLLM capture ``declared`` for this DFlash config."""
    why = refusal(arch)
    if why:
        return why
    if config.get("speculators_model_type") == "dflash":
        return (f"aux_hidden_state_layer_ids is {json.dumps(config.get('aux_hidden_state_layer_ids'))}; write "
                f'"aux_hidden_state_layer_ids": {json.dumps(declared)} (speculators ids are boundaries), or '
                "re-export with `eaglewire export --to vllm`")
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return (f"eagle_aux_hidden_state_layer_ids is {json.dumps(config['eagle_aux_hidden_state_layer_ids'])}; "
                f'write "eagle_aux_hidden_state_layer_ids": {json.dumps(declared)} (vLLM reads it first, verbatim)')
    written = (config.get("dflash_config") or {}).get("target_layer_ids")
    return (f"dflash_config.target_layer_ids is {json.dumps(written)}; write \"dflash_config\": "
            f'{{"target_layer_ids": {json.dumps([b - 1 for b in declared])}}} (vLLM adds 1), or re-export with '
            "`eaglewire export --to vllm`")


def parse_dflash_config(d: dict[str, Any], *, where: str = "config.json"
                        ) -> tuple[dict[str, Any], list[int] | None, list[str]]:
    """(DFlashConfig fields but num_aux / vocab_size, ids or None, notes) of a speculators DFlash directory."""
    from eaglewire.engines.formats.dflash_layout import is_speculators, parse

    if not is_speculators(d):
        raise FormatError(f"{where} is not a speculators DFlash config (no speculators_model_type \"dflash\"); "
                          "a z-lab / SpecForge directory imports with --from zlab")
    fields, vocab = parse(d, where=where)
    layers = d["transformer_layer_config"]
    if vocab is not None and layers.get("vocab_size") is not None and int(vocab) != int(layers["vocab_size"]):
        fields["draft_vocab_size"] = int(vocab)  # a pruned vocabulary: d2t / t2d and lm_head rows in the weights
    found, notes = read_dflash_ids(d)
    return fields, next(iter(found.values())), notes


def export_dflash(draft: DraftFiles, fmt: str, out: Path, config: ExportConfig, *, target=None,
                  allow: frozenset[str] | set[str] = frozenset(), others: OtherReadings | None = None) -> ExportReport:
    """Write a DFlash ``draft`` in speculators' layout (vLLM loads it; ids = boundaries). A pruned vocabulary
    needs the target's head (``target``, else loaded from the spec the draft records) for its rows."""
    from eaglewire.engines.formats.dflash_layout import head_rows_tensor, speculators_config

    contract, cfg = draft.contract, draft.draft_config
    bounds, L = list(contract.aux_boundaries), contract.num_layers
    arch = export_arch(config, contract)
    ids = dflash_to_ids(bounds, L, arch)
    name = verifier(config, draft)
    notes = speculators.verifier_notes(name, is_local_path=bool(name) and Path(name).expanduser().exists())
    dtype = serving_dtype(draft.target_spec, contract.target.dtype, notes)
    engine_config = {**speculators_config(cfg, ids, verifier_name=name, dtype=dtype,
                                          verifier_architecture=contract.target.architecture),
                     **record(draft, arch, f"vllm {VERSION}")}
    tensors = draft.state()  # a pruned vocabulary's d2t / t2d under speculators' own names and offsets
    head_note = "The draft uses the target's embedding and lm_head (none are stored)."
    if cfg.pruned:  # speculators and vLLM load a pruned draft's lm_head from the checkpoint: the target's rows
        target = target if target is not None else load_export_target(draft)
        notes += contract.check_target(target.fingerprint, what=f"draft {draft.path}", allow=allow)
        tensors["lm_head.weight"] = head_rows_tensor(tensors["d2t"], target, getattr(torch, dtype))
        head_note = (f"The draft predicts over {cfg.draft_vocab_size} of the target's {cfg.vocab_size} tokens: "
                     "`lm_head.weight` is the target head's rows of them, `d2t` / `t2d` map them (target id = draft "
                     "id + d2t); the embedding is the target's.")
    spec = json.dumps({"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": cfg.block_size - 1})
    serving = "\n".join([
        "# Serving this DFlash draft with vLLM", "",
        f"speculators DFlash format, for vLLM {VERSION}. The draft reads target boundaries {bounds}; vLLM's "
        f"update_dflash copies `aux_hidden_state_layer_ids` {json.dumps(ids)} to the ids its runner captures "
        "verbatim (0 = embedding output, L = last layer before the final norm), and sets "
        "`dflash_config.causal = not sliding_window_non_causal` (written true: the block is bidirectional, as "
        "trained).", "",
        "```bash", f"vllm serve {name or '<the target>'} \\", f"    --speculative-config '{spec}'", "```", "",
        f"`num_speculative_tokens` is at most block_size - 1 = {cfg.block_size - 1}: one draft pass per block. "
        + head_note, "",
        "## Other engines loading this directory", "",
        "- SGLang cannot load the speculators layout (no DFlashSpeculator model): use "
        "`eaglewire export --to sglang`.",
        "- llama.cpp's converter has no DFlashSpeculator either: use `eaglewire export --to llamacpp`.", ""])
    files = write_export(out, engine_config, tensors, serving)
    return finish(ExportReport(format=fmt, out_dir=out, aux_boundaries=bounds, engine_ids=ids, files=files,
                               notes=notes))


# ---------------------------------------------------------------- sampling (doctor --temperature)

ACCEPTANCE_RULE = ("vLLM 0.33.0's rejection sampler with greedy drafts (draft_prob 1: accepted when p_T(x) >= "
                   "uniform)")
OWN_DEFAULTS = "vllm"  # --generation-config vllm: vLLM's own defaults, not the model's


def launch_temperature(flags: str, target_dir: Path | None) -> Temperature | None:
    """vLLM 0.33.0 (vllm/config/model.py ``get_diff_sampling_param``): ``--override-generation-config``'s
    temperature over the generation config of ``--generation-config`` (auto: the model's; vllm: none; a
    folder: its file)."""
    args, _ = parse_flexible(flags, {})  # neither flag has a short alias in vLLM 0.33.0
    override = args.get("--override-generation-config")
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except json.JSONDecodeError:
            raise ValueError(f"--engine-flags --override-generation-config {override!r} is not a JSON object") from None
    if isinstance(override, dict) and override.get("temperature") is not None:
        value = temperature_value(override["temperature"], "--engine-flags --override-generation-config")
        return Temperature(value, "vLLM's --override-generation-config in --engine-flags")
    source = args.get("--generation-config", "auto")
    if source == OWN_DEFAULTS:
        return None
    return generation_config_temperature(target_dir if source == "auto" else Path(source).expanduser(),
                                         "vLLM (--generation-config " + ("auto" if source == "auto" else source) + ")")


# ---------------------------------------------------------------- the chat template's switches at launch

TEMPLATE_KWARGS_FLAG = "--default-chat-template-kwargs"  # vllm/entrypoints/common/cli_args.py FrontendArgs
# (0.32.0: vllm/entrypoints/launchers/cli_args.py FrontendArgs, the same field and json.loads; CITED_BY_VERSION)


def launch_template_kwargs(flags: str) -> dict[str, Any] | None:
    """The chat-template kwargs vLLM 0.33.0 renders every chat request with by default
    (``--default-chat-template-kwargs JSON``, read with ``json.loads``: vllm/entrypoints/common/cli_args.py;
    a request's own ``chat_template_kwargs`` take precedence: vllm/renderers/params.py ``merge_kwargs``);
    None when the flags set none."""
    from eaglewire.engines.serving.launch_flags import template_kwargs_value

    args, _ = parse_flexible(flags, FLAG_ALIASES)
    value = args.get(TEMPLATE_KWARGS_FLAG)
    return None if value is None else template_kwargs_value(TEMPLATE_KWARGS_FLAG, value)


def template_kwargs_fix(kwargs: dict[str, Any]) -> str:
    """The launch flag that makes vLLM render as ``kwargs`` says."""
    return f"{TEMPLATE_KWARGS_FLAG} '{json.dumps(kwargs, sort_keys=True)}'"
