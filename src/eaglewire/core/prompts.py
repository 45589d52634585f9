"""Evaluation prompt sets: MT-bench and HumanEval from their packages, or a JSONL file."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from eaglewire.core.presets import data_path


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool  # wrap in the chat template (instructions) or not (code completion)


def load_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    """``mt-bench`` (first turns, 80), ``humaneval`` (164 completions) or a JSONL file of
    ``{"prompt": ...}`` / ``{"turns": [...]}`` / ``{"messages": [...]}`` records."""
    if name == "mt-bench":
        rows = _jsonl(data_path("mt-bench"))
        prompts = [Prompt(str(r["question_id"]), r["turns"][0], True) for r in rows]
    elif name == "humaneval":
        with gzip.open(data_path("humaneval"), "rt") as f:
            prompts = [Prompt(r["task_id"], r["prompt"], False) for r in map(json.loads, f)]
    else:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"prompt set {name!r} is neither mt-bench, humaneval nor a JSONL file")
        prompts = [_from_record(i, r) for i, r in enumerate(_jsonl(path))]
    return prompts[:limit] if limit else prompts


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _from_record(i: int, r: dict) -> Prompt:
    if "prompt" in r:
        return Prompt(str(r.get("id", i)), r["prompt"], bool(r.get("chat", False)))
    if "turns" in r:
        return Prompt(str(r.get("question_id", i)), r["turns"][0], True)
    if "messages" in r:
        user = next(m["content"] for m in r["messages"] if m.get("role") == "user")
        return Prompt(str(r.get("id", i)), user, True)
    raise ValueError(f"prompt record {i} has none of prompt / turns / messages: {str(r)[:100]}")
