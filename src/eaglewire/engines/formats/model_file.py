"""What one engine release's target model file does with a draft config's layer ids.

SGLang and vLLM both pick the aux states inside each target's model file; ``ModelFile``
records, per file, where the rule lives (path and function in the engine's wheel) and what
it captures. The tables themselves live with their engine (engines/sglang/readings.py, engines/vllm/readings.py);
tests/engines re-reads every cited function from the released wheels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eaglewire.core.contract import ContractError, EngineConventionError


@dataclass(frozen=True, kw_only=True)
class ModelFile:
    """How one engine release's target model file turns config ids into captured boundaries."""

    engine: str
    path: str  # in the engine's wheel
    function: str  # where the id rule lives
    ids: str  # plus_one | plus_one_if_first_is_one | verbatim_if_max_is_L | verbatim
    captures_last: bool  # boundary L (after the last layer, before the norm) can be captured
    block_output: bool = False  # captures a layer's output without the residual, not the stream
    unsupported: str | None = None  # why this engine serves no EAGLE-3 draft on this target


def layers_to_capture(ids: list[int], rule: str, num_layers: int) -> list[int]:
    """The ``layers_to_capture`` a ``set_eagle3_layers_to_capture`` sets for ``ids`` under ``rule``."""
    ids = list(ids)
    if rule == "verbatim":
        return ids
    if rule == "plus_one":
        return [i + 1 for i in ids]
    if rule == "plus_one_if_first_is_one":
        return [i + 1 for i in ids] if ids and ids[0] == 1 else ids
    if rule == "verbatim_if_max_is_L":
        return ids if ids and max(ids) == num_layers else [i + 1 for i in ids]
    raise ContractError(f"unknown SGLang id rule {rule!r}")


def captured_boundaries(layers: list[int], num_layers: int, captures_last: bool) -> list[int]:
    """Boundaries a forward captures for ``layers_to_capture``: the input of each layer ``i in
    layers`` (in layer order) and, where the file does, the stream after the last layer."""
    got = sorted({i for i in layers if 0 <= i < num_layers})
    return got + [num_layers] if captures_last and num_layers in layers else got


def read(ids: list[int], num_layers: int, f: ModelFile) -> list[int]:
    """Boundaries model file ``f`` captures for config ``ids``, in the order it feeds them."""
    return captured_boundaries(layers_to_capture(ids, f.ids, num_layers), num_layers, f.captures_last)


def read_every(ids: list[int], num_layers: int, f: ModelFile, engine: str) -> list[int]:
    """``read``, and an EngineConventionError when an id names no captured layer (or repeats one):
    the draft would get fewer states than its fc takes. ``engine`` names the release, e.g. "SGLang 0.5.23"."""
    bounds = read(ids, num_layers, f)
    if len(bounds) != len(ids):
        raise EngineConventionError(
            f"{engine}'s {f.path} captures only boundaries {bounds} for ids {ids} on a {num_layers}-layer "
            f"target: {len(ids) - len(bounds)} of them name no layer it captures (or repeat one), so the "
            f"draft would get {len(bounds)} states for an fc that takes {len(ids)}")
    return bounds


def why_not(to_ids: Callable[[list[int], int, str | None], list[int]], declared: list[int], num_layers: int,
            arch: str | None) -> str:
    """Why an engine whose ``to_ids`` translates boundaries cannot capture ``declared`` ('' if it can)."""
    try:
        to_ids(declared, num_layers, arch)
    except EngineConventionError as e:
        return str(e)
    return ""


# A *ForConditionalGeneration target wraps a text model; each engine serves it from the wrapper's own
# model file, which forwards the aux-layer ids to its language model (or does not). Wrapper class
# (lower case) -> the text model's architecture key, which the wrapper's reading defers to.
WRAPPERS: dict[str, str] = {
    "gemma3forconditionalgeneration": "gemma3",
    "llavaforconditionalgeneration": "llama",
    "mistral3forconditionalgeneration": "mistral",
    "qwen2vlforconditionalgeneration": "qwen2",
    "qwen2_5_vlforconditionalgeneration": "qwen2",
}


def wrapper_key(arch: str | None) -> str | None:
    """``arch``'s WRAPPERS key when it names a wrapped (multimodal) target, else None."""
    key = str(arch or "").strip().lower()
    return key if key in WRAPPERS else None


def wrapped(text: ModelFile, path: str, function: str, *, forwards: bool, why: str | None = None) -> ModelFile:
    """The reading of a wrapper served from ``path``: the text model ``text``'s rule when the wrapper
    forwards the ids to it (``function`` says where), else unsupported (``why``)."""
    if not forwards:
        return ModelFile(engine=text.engine, path=path, function=function, ids=text.ids, captures_last=False,
                         unsupported=why)
    return ModelFile(engine=text.engine, path=path, function=f"{function} -> {text.path} {text.function}",
                     ids=text.ids, captures_last=text.captures_last, block_output=text.block_output,
                     unsupported=text.unsupported and f"{text.unsupported} (through {path})")
