"""Use a draft directory from another tool where a native draft is expected.

The directory's format is detected from its config.json and it is converted in memory (into a
temporary directory) through ``engines.import_draft``, which states the convention it read the
ids in. Detection:

| config.json                                   | read as      | ids mean                       |
|-----------------------------------------------|--------------|--------------------------------|
| ``format: eaglewire-eagle3``                  | native       | the recorded contract          |
| ``speculators_model_type``                    | speculators  | boundaries verbatim            |
| ``eagle_config.eagle_aux_hidden_state_layer_ids`` | specforge | output of layer i (boundary i + 1) |
| none of these                                 | eagle        | the hard-coded [2, L//2, L-3]  |

SGLang and SpecForge write the same files; SGLang reads the ids per target model file
(``engines/sglang/readings.py``), and the import's notes name the readings that disagree. An eaglewire export's recorded contract wins.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from eaglewire.core.errors import read_json_object
from eaglewire.model.checkpoint import CHECKPOINT_FORMAT, DAMAGED_DRAFT, load_draft
from eaglewire.engines import vllm
from eaglewire.engines.formats import eagle, specforge
from eaglewire.core.presets import resolve_draft

log = logging.getLogger(__name__)


def detect_draft_format(path: str | Path) -> str:
    """``native``, ``speculators``, ``specforge`` or ``eagle`` (see the module table)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path} is not a draft directory: no config.json (train one with `eaglewire "
                                "train`, or pass an SGLang, SpecForge, speculators or EAGLE draft directory)")
    config = read_json_object(cfg_path, DAMAGED_DRAFT)
    if config.get("format") == CHECKPOINT_FORMAT:
        return "native"
    if "speculators_model_type" in config:
        return vllm.FORMAT_NAME
    if isinstance(config.get("eagle_config"), dict):
        return specforge.NAME
    return eagle.NAME


def load_any_draft(path: str | Path, *, target, allow: set[str] | frozenset[str] = frozenset(),
                   check_native: bool = True, **kw) -> tuple[Any, Any, dict[str, Any], list[str]]:
    """(draft, contract, config, notes) of a native or foreign draft directory, for ``target``.

    A foreign draft gets ``target``'s fingerprint in its contract (it records none); the first
    note states the format and the boundaries its ids were read as. ``check_native=False``
    loads a native draft without checking its contract against ``target`` (the doctor judges
    that as a verdict instead of an exception); notes are empty for a native draft.
    """
    native = resolve_draft(path)
    fmt = detect_draft_format(native)
    if fmt == "native":
        return (*load_draft(native, target=target if check_native else None, allow=allow, **kw), [])
    from eaglewire.engines import import_draft

    with tempfile.TemporaryDirectory(prefix="eaglewire-draft-") as tmp:
        report = import_draft(native, fmt, target, Path(tmp) / "draft", allow=allow)
        draft, contract, config = load_draft(Path(tmp) / "draft", target=target, allow=allow, **kw)
    ids = "no ids" if report.engine_ids is None else f"config ids {report.engine_ids}"
    notes = [f"{native} is a {fmt} draft (detected): {ids} read in {fmt}'s convention as boundaries "
             f"{report.aux_boundaries}"] + report.notes
    for note in notes:
        log.info("%s", note)
    return draft, contract, config, notes
