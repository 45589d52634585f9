"""The served-wiring check's fixes, proven before they are printed (``diagnosis.py``).

A fix is printed only if it changes what the server computes back to what the draft was trained with:

- a fix that writes config keys (``"key": value`` in its text, nested under a section it names with
  ``inside "S"``) is applied to the parsed ``--engine-config`` and the result read again through the
  engine's own reading (``serving.read_engine_config`` / ``read_fields``): the field it claims to fix must
  then read as trained, and nothing else may read otherwise than before;
- a fix for a field the user's ``--engine-config`` already holds as trained changes nothing in that
  file: the server runs another copy. The fix printed instead makes the server load the user's copy or
  changes the served copy's line.

The pure parts (``config_edit``, ``apply_edit``, ``held_fields``, ``prove``) take parsed configs and a
reader; ``diagnosis.py`` builds the reader from the engine's.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

LAYOUT = "layout"  # the aspect of a wiring that feeds other boundaries (the ids in the engine's config)

_KEY = re.compile(r'"([A-Za-z_][\w.]*)"\s*:\s*')
_SECTION = re.compile(r'inside "([A-Za-z_]\w*)"')


def config_edit(fix: str | None) -> dict[str, Any] | None:
    """The config keys a printed ``fix`` writes, as a nested dict (a dotted key nests; ``inside "S"`` nests every
    key under S), or None where the fix writes no key (a re-export, a tensor to write)."""
    if not fix:
        return None
    edit: dict[str, Any] = {}
    decoder, pos = json.JSONDecoder(), 0
    while (m := _KEY.search(fix, pos)) is not None:
        try:
            value, end = decoder.raw_decode(fix, m.end())
        except ValueError:
            pos = m.end()
            continue
        _merge(edit, _nested(m.group(1).split("."), value))
        pos = end
    if not edit:
        return None
    section = _SECTION.search(fix)
    return _nested([section.group(1)], edit) if section else edit


def _nested(path: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


def _merge(into: dict[str, Any], edit: dict[str, Any]) -> dict[str, Any]:
    for key, value in edit.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


def apply_edit(config: dict[str, Any], edit: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with ``edit``'s keys written (sections merged, not replaced)."""
    return _merge(copy.deepcopy(config), edit)


def held_fields(readings: dict[str, list[int]], declared: list[int], found: list[str] | None,
                fields: tuple[str, ...]) -> set[str]:
    """The aspects a config holds as trained, as the engine reads it: LAYOUT where every reading (label ->
    boundaries fed) is ``declared``, and each of ``fields`` not among the fields ``found`` read otherwise
    (None: the fields were not read)."""
    held = {LAYOUT} if readings and all(list(b) == list(declared) for b in readings.values()) else set()
    return held | (set(fields) - set(found) if found is not None else set())


HEAD_ROWS = "lm_head rows"  # an aspect no config field shows: the rows of the checkpoint's lm_head.weight


def holds_trained_head(directory: Path, draft) -> bool:
    """Whether the draft checkpoint beside an ``--engine-config`` (its ``*.safetensors``) holds the draft's own
    lm_head rows, compared in the dtype stored (an export in bf16 rounds them): then "another lm_head" is another
    copy's, and loading this one fixes it."""
    import torch
    from safetensors import SafetensorError, safe_open

    mine = draft.lm_head.weight.detach().float().cpu()  # [Vd, H]
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                name = next((k for k in f.keys() if k.endswith("lm_head.weight")), None)
                if name is not None:
                    rows = f.get_tensor(name)  # [Vd, H] as stored
                    return tuple(rows.shape) == tuple(mine.shape) and torch.equal(rows, mine.to(rows.dtype))
        except (OSError, SafetensorError):  # a cut or foreign file: nothing proven
            return False
    return False


def absent_tensors(directory: Path, names: tuple[str, ...]) -> set[str]:
    """Of ``names`` (tensor names, matched as suffixes), those no ``*.safetensors`` beside an ``--engine-config``
    carries: the engine takes the target's rows for those (a DFlash export ships no embed_tokens, and an lm_head
    only for a pruned vocabulary). None proven where there is no checkpoint or one cannot be read."""
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return set()
    keys: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), "pt") as f:
                keys += list(f.keys())
        except (OSError, SafetensorError):  # a cut or foreign file: nothing proven
            return set()
    return {name for name in names if not any(k.endswith(name) for k in keys)}


@dataclass(frozen=True)
class ConfigView:
    """The user's ``--engine-config`` as the engine reads it: what it holds as trained, and how to read an edit."""

    path: str
    config: dict[str, Any] | None  # parsed JSON; None: a file of the engine's own (a GGUF), not edited here
    held: set[str]  # LAYOUT and the fields it holds as trained (held_fields)
    differs: set[str]  # the aspects it reads otherwise than trained
    reread: Callable[[dict[str, Any]], tuple[set[str], set[str]]] | None = None  # edited -> (held, differs)


def prove(aspect: str | None, fix: str | None, view: ConfigView | None) -> tuple[str, str]:
    """Whether a wiring's ``fix`` may be printed: ("print", ""), ("held", why): ``view``'s config already holds
    ``aspect`` as trained, so the fix changes nothing in it; ("unproven", why): applied to the config and read
    again, the aspect is still read otherwise or something else now is. ``aspect``: what the wiring reads
    otherwise (LAYOUT, a field name), None where no config reading shows it (fc's columns, the head's rows)."""
    if view is None or aspect is None or not fix:
        return "print", ""
    if aspect in view.held:
        return "held", f"{view.path} already holds {_said(aspect)} as trained"
    edit = config_edit(fix)
    if edit is None or view.config is None or view.reread is None:
        return "print", ""  # not a config edit, or a file not edited here: the fix rebuilds what training used
    held, differs = view.reread(apply_edit(view.config, edit))
    if aspect not in held:
        return "unproven", f"applied to {view.path}, the engine still reads {_said(aspect)} otherwise than trained"
    new = differs - view.differs
    if new:
        return "unproven", f"applied to {view.path}, the engine then reads {', '.join(sorted(new))} otherwise"
    return "print", ""


def _said(aspect: str) -> str:
    return "the layers fed" if aspect == LAYOUT else "the draft's lm_head rows" if aspect == HEAD_ROWS else aspect
