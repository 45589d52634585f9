"""Launch flags as an engine reads them: the shell split every engine's lint starts from, and
the chain-shape check that SGLang-style flags (SGLang, eaglewire) share. Pure functions."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Flags:
    """What an engine's launch flags ask for, and what it would silently change or refuse."""

    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (verdict, what, fix)


def _is_flag(token: str) -> bool:
    if not token.startswith("-"):
        return False
    try:
        float(token)  # "-1" is a value
        return False
    except ValueError:
        return True


def parse_flags(flags: str) -> dict[str, str]:
    """Launch flags as a shell would split them -> {flag as written: value}: ``--x v``, ``--x=v``
    and ``-x v``; a flag without a value maps to ""."""
    tokens, out, i = shlex.split(flags), {}, 0
    while i < len(tokens):
        tok = tokens[i]
        if _is_flag(tok):
            name, eq, value = tok.partition("=")
            if not eq and i + 1 < len(tokens) and not _is_flag(tokens[i + 1]):
                value, i = tokens[i + 1], i + 1
            out[name] = value
        i += 1
    return out


def as_int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def chain_shape(args: dict[str, str], out: Flags, *, verdict: str, silently: str) -> Flags:
    """``--speculative-num-steps / -eagle-topk / -num-draft-tokens`` into ``out``, and the chain
    whose draft tokens are not steps + 1 (``verdict`` and ``silently``: what the engine does then)."""
    out.num_steps = as_int(args.get("--speculative-num-steps"))
    out.topk = as_int(args.get("--speculative-eagle-topk"))
    out.num_draft_tokens = as_int(args.get("--speculative-num-draft-tokens"))
    steps, topk, tokens = out.num_steps, out.topk, out.num_draft_tokens
    if topk == 1 and steps is not None and tokens is not None and tokens != steps + 1:
        out.problems.append((verdict, f"--speculative-eagle-topk 1 with --speculative-num-draft-tokens {tokens} != "
                             f"--speculative-num-steps {steps} + 1: {silently}",
                             f"--speculative-num-draft-tokens {steps + 1}"))
    return out
