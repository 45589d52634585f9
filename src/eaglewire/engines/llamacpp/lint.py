"""llama-server's speculative launch flags (build ``BUILD``): what it would silently change,
ignore or refuse."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from eaglewire.engines.serving.launch_flags import parse_flags
from eaglewire.engines.llamacpp.installation import BUILD
from eaglewire.engines.serving.sampling_defaults import Temperature

# flag -> what replaced it (removed at this build: llama-server exits on them)
REMOVED_FLAGS = {"--draft": "--spec-draft-n-max", "--draft-n": "--spec-draft-n-max", "--draft-max": "--spec-draft-n-max",
                 "--draft-min": "--spec-draft-n-min", "--draft-n-min": "--spec-draft-n-min"}
DRAFT_MODEL_FLAGS = ("-md", "--model-draft", "--spec-draft-model")
DEFAULT_N_MAX = 3  # llama.cpp's --spec-draft-n-max default
# common/speculative.cpp's types that run the -md model (each reads its own GGUF architecture)
DRAFT_MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")


def spec_types(flags: str) -> list[str] | None:
    """Every ``--spec-type`` given, in order: common/arg.cpp appends each flag's comma-separated list to the
    types llama-server runs (repeating the flag adds types, it does not replace them); None: not given."""
    tokens, found = shlex.split(flags), None
    for i, tok in enumerate(tokens):
        name, eq, value = tok.partition("=")
        if name == "--spec-type":
            value = value if eq else (tokens[i + 1] if i + 1 < len(tokens) else "")
            found = (found or []) + [t for t in value.split(",") if t]
    return found


@dataclass
class LlamaFlags:
    num_steps: int | None = None  # --spec-draft-n-max as given (None: llama.cpp's default 3)
    n_min: int | None = None
    p_min: float | None = None
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (verdict, what, fix)
    draft_path: str | None = None  # the -md GGUF, as written


def lint_flags(flags: str, declared: list[int] | None = None, num_layers: int | None = None,
               arch: str | None = None) -> LlamaFlags:
    """llama-server launch flags that would serve the EAGLE-3 draft otherwise than meant (the wiring
    is read from the GGUF, not the flags: ``declared``, ``num_layers`` and ``arch`` are unused)."""
    return _lint(flags, "draft-eagle3", None)


# common/speculative.cpp common_speculative_impl_draft_dflash (build BUILD): the block is
# [id_last, mask x n_max]; n_max (and n_min) above the GGUF's dflash.block_size - 1 are clamped to it
# with only a log warning.
def lint_dflash_flags(flags: str, declared: list[int] | None, num_layers: int | None, arch: str | None,
                      block_size: int) -> LlamaFlags:
    """llama-server launch flags for a DFlash GGUF trained with blocks of ``block_size``."""
    return _lint(flags, "draft-dflash", block_size)


def _lint(flags: str, spec_type: str, block_size: int | None) -> LlamaFlags:
    family = "DFlash" if block_size else "EAGLE-3"
    args = parse_flags(flags)
    out = LlamaFlags()
    for old, new in REMOVED_FLAGS.items():
        if old in args:
            out.problems.append(("fail", f"{old} was removed before build {BUILD}: llama-server exits on it",
                                 f"use {new}"))
    out.draft_path = next((args[f] for f in DRAFT_MODEL_FLAGS if args.get(f)), None)
    if not any(f in args for f in DRAFT_MODEL_FLAGS):
        out.problems.append(("fail", "no draft model (-md): llama-server decodes without speculation",
                             f"add -md draft.gguf --spec-type {spec_type}"))
    kinds = spec_types(flags)
    if kinds is None:
        out.problems.append(("warn", f"no --spec-type: build {BUILD} infers {spec_type} from the GGUF's "
                             "metadata, other builds may not", f"add --spec-type {spec_type}"))
    elif spec_type not in kinds:
        out.problems.append(("fail", f"--spec-type {','.join(kinds)}: llama.cpp will not feed target states to the "
                             f"{family} draft", f"--spec-type {spec_type}"))
    elif others := sorted({k for k in kinds if k in DRAFT_MODEL_TYPES and k != spec_type}):
        out.problems.append(("fail", f"--spec-type {','.join(kinds)}: llama-server runs every type given (a repeated "
                             f"--spec-type adds to the list), so the {family} GGUF is also run as {', '.join(others)}",
                             f"give --spec-type {spec_type} once"))
    n_max, n_min, p_min = (args.get(k) for k in ("--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min"))
    out.num_steps = _number(n_max, "--spec-draft-n-max", out)
    out.n_min = _number(n_min, "--spec-draft-n-min", out)
    out.p_min = _number(p_min if p_min is not None else args.get("--draft-p-min"), "--spec-draft-p-min", out, float)
    steps = out.num_steps if out.num_steps is not None else DEFAULT_N_MAX
    if out.num_steps == 0:
        out.problems.append(("fail", "--spec-draft-n-max 0: nothing is drafted", "--spec-draft-n-max 3"))
    if out.n_min is not None and out.n_min > steps:
        out.problems.append(("fail", f"--spec-draft-n-min {out.n_min} > --spec-draft-n-max {steps}: every draft is "
                             "shorter than the minimum and dropped, silently", "--spec-draft-n-min 0"))
    if out.p_min:
        out.problems.append(("warn", f"--spec-draft-p-min {out.p_min:g}: drafting stops at the first token the draft "
                             "is less sure of, so τ falls short of the chain's prediction",
                             "--spec-draft-p-min 0 to draft the full chain (when measuring τ)"))
    if block_size and max(steps, out.n_min or 0) > block_size - 1:
        out.problems.append(("warn", f"--spec-draft-n-max {steps}" + (f" / -n-min {out.n_min}" if out.n_min else "") +
                             f" above the trained block's {block_size - 1} drafted positions: llama.cpp clamps them "
                             "to it with only a log warning", f"--spec-draft-n-max {block_size - 1}"))
        out.num_steps = min(steps, block_size - 1)
    if args.get("--spec-draft-sampling") == "probabilistic":
        out.problems.append(("warn", "--spec-draft-sampling probabilistic: greedy acceptance no longer applies; "
                             "τ is not comparable with greedy predictions", "--spec-draft-sampling greedy"))
    threads = {k: args.get(k) for k in ("-t", "-td")}
    if threads["-t"] and not threads["-td"]:
        out.problems.append(("warn", f"-t {threads['-t']} without -td: the draft's thread count is left to "
                             "llama.cpp", f"-td {threads['-t']} -tbd {threads['-t']}"))
    return out


def _number(value: str | None, flag: str, out: LlamaFlags, kind: type = int):
    """``value`` as ``kind`` (int or float); None, with a problem recorded, when llama-server would refuse it."""
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        what, fix = ("an integer", 3) if kind is int else ("a number", 0)
        out.problems.append(("fail", f"{flag} {value!r} is not {what}: llama-server refuses it", f"{flag} {fix}"))
        return None


# ---------------------------------------------------------------- the chat template's switches at launch

TEMPLATE_KWARGS_FLAG = "--chat-template-kwargs"  # common/arg.cpp: params.default_template_kwargs
REASONING_FLAGS = ("--reasoning", "-rea")  # common/arg.cpp: on/off set default_template_kwargs["enable_thinking"]
_ON, _OFF = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")


def launch_template_kwargs(flags: str) -> dict | None:
    """The chat-template kwargs llama-server renders every chat request with by default: its
    ``--chat-template-kwargs JSON``, and ``--reasoning on|off`` setting ``enable_thinking`` (common/arg.cpp
    at this build; ``auto`` leaves the template's default); a request's own ``chat_template_kwargs``
    override them (tools/server/server-common.cpp). None when the flags set none."""
    from eaglewire.engines.serving.launch_flags import template_kwargs_value

    args = parse_flags(flags)
    out = None
    if (value := args.get(TEMPLATE_KWARGS_FLAG)) is not None:
        out = dict(template_kwargs_value(TEMPLATE_KWARGS_FLAG, value))
    reasoning = next((args[f] for f in REASONING_FLAGS if f in args), None)
    if reasoning is not None and reasoning.lower() in _ON + _OFF:
        out = {**(out or {}), "enable_thinking": reasoning.lower() in _ON}
    return out


def template_kwargs_fix(kwargs: dict) -> str:
    """The launch flags that make llama-server render as ``kwargs`` says."""
    import json

    thinking = kwargs.get("enable_thinking")
    rest = {k: v for k, v in kwargs.items() if k != "enable_thinking"}
    parts = [f"--reasoning {'on' if thinking else 'off'}"] if isinstance(thinking, bool) else []
    if rest or not parts:
        parts.append(f"{TEMPLATE_KWARGS_FLAG} '{json.dumps(rest if parts else kwargs, sort_keys=True)}'")
    return " ".join(parts)


# ---------------------------------------------------------------- sampling (doctor --temperature)
# common/sampling.cpp at this build: the target samples each position and a drafted token is kept when it equals
# the sample.
ACCEPTANCE_RULE = ("llama.cpp b11434's common_sampler_sample_and_accept_n (the target samples, accepted when "
                   "equal)")


def launch_temperature(flags: str, target_dir: Path | None) -> Temperature | None:
    """llama-server's ``--temp`` / ``--temperature N`` (b11434 common/arg.cpp: ``std::max(stof(N), 0)``;
    the last one given wins, as its argument loop sets it each time)."""
    args = parse_flags(flags)
    given = [f for f in args if f in ("--temp", "--temperature")]
    if not given:
        return None
    raw = args[given[-1]]
    try:
        value = max(float(raw), 0.0)  # llama.cpp clamps a negative temperature to 0 (greedy)
    except ValueError:
        raise ValueError(f"--engine-flags {given[-1]} {raw!r} is not a number (llama-server refuses it)") from None
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"--engine-flags {given[-1]} {raw!r} is not a temperature")
    return Temperature(value, f"llama-server's {given[-1]} in --engine-flags")
