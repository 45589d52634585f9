"""What every engine's reading of its sampling defaults shares: ``Temperature`` (the temperature users sample at and
where it was read) and the model's generation config as an engine applies it. Each engine's own reader of its
launch flags, and the rule it accepts a drafted token by when it samples, are its spec's ``sampling``
(``interface.Sampling``), with the citations; ``doctor/temperature.py``'s text gives them whole.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"


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


def generation_config_temperature(folder: Path | None, who: str) -> Temperature | None:
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
