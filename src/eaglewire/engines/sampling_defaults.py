"""What each engine's sampling defaults are at launch, read from its flags and the model's generation config
(the readers ``doctor --temperature`` uses when it is not told), and the rule each engine accepts a drafted
token by when it samples. The citations are in each reader; ``doctor/sampling.py``'s text gives them whole.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eaglewire.engines.eaglewire import NAME as EAGLEWIRE
from eaglewire.engines.flags import parse_flags, parse_flexible
from eaglewire.engines.llamacpp.readings import NAME as LLAMACPP
from eaglewire.engines.sglang import NAME as SGLANG
from eaglewire.engines.vllm import NAME as VLLM

GENERATION_CONFIG = "generation_config.json"
VLLM_OWN_DEFAULTS = "vllm"  # --generation-config vllm: vLLM's own defaults, not the model's


@dataclass(frozen=True)
class Temperature:
    """The temperature users sample at, where the doctor read it, and what else it saw there."""

    value: float
    source: str
    notes: tuple[str, ...] = ()


def temperature_value(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{where}: temperature {value!r} is not a number")
    try:
        t = float(value)
    except ValueError:
        raise ValueError(f"{where}: temperature {value!r} is not a number") from None
    if not t >= 0 or math.isinf(t):
        raise ValueError(f"{where}: temperature {value!r} is not a number >= 0")
    return t



def _generation_config(folder: Path | None, who: str) -> Temperature | None:
    """``temperature`` in ``folder``/generation_config.json, as ``who`` applies it to requests that send none."""
    if folder is None or not (folder / GENERATION_CONFIG).is_file():
        return None
    path = folder / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} does not parse as JSON ({e})") from None
    if not isinstance(config, dict) or config.get("temperature") is None:
        return None
    value = temperature_value(config["temperature"], str(path))
    notes = [f"{path}: temperature {value:g}, which {who} applies to every request that sends none"]
    if config.get("do_sample") is False:
        notes.append("its do_sample false is not read by the engine: it samples all the same")
    return Temperature(value, f"the target's {GENERATION_CONFIG}, {who}'s default", tuple(notes))


def llamacpp_temperature(flags: str, target_dir: Path | None) -> Temperature | None:
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


def vllm_temperature(flags: str, target_dir: Path | None) -> Temperature | None:
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
    if source == VLLM_OWN_DEFAULTS:
        return None
    return _generation_config(target_dir if source == "auto" else Path(source).expanduser(),
                              "vLLM (--generation-config " + ("auto" if source == "auto" else source) + ")")


def sglang_temperature(flags: str, target_dir: Path | None) -> Temperature | None:
    """SGLang 0.5.23: the model's generation config under ``--sampling-defaults model`` (its default;
    sglang/srt/arg_groups/fields/serving.py), for chat completions."""
    if parse_flags(flags).get("--sampling-defaults", "model") != "model":
        return None
    return _generation_config(target_dir, "SGLang chat completions (--sampling-defaults model)")


# engine (canonical name) -> its reader of the launch flags and the model's generation config; the
# citations are in each reader and in the module's text
LAUNCH_READERS: dict[str, Callable[[str, Path | None], Temperature | None]] = {
    LLAMACPP: llamacpp_temperature,
    VLLM: vllm_temperature,
    SGLANG: sglang_temperature,
}


RULES = {  # canonical engine -> how it accepts a drafted token when sampling (the module's text cites each)
    VLLM: "vLLM 0.33.0's rejection sampler with greedy drafts (draft_prob 1: accepted when p_T(x) >= uniform)",
    SGLANG: "SGLang 0.5.23's tree_speculative_sampling_target_only (thresholds 1.0: accepted when coin < p_T(x))",
    LLAMACPP: "llama.cpp b11434's common_sampler_sample_and_accept_n (the target samples, accepted when equal)",
    EAGLEWIRE: "eaglewire's sampling_verify (a chain's token accepted with p_T(x))",
}


def acceptance_rule(engine: str) -> str:
    """How ``engine`` (any name or alias) accepts a drafted token when sampling; eaglewire's rule for an engine
    whose rule was not read."""
    from eaglewire.engines.registry import canonical

    return RULES.get(canonical(engine), RULES[EAGLEWIRE])

