"""Launch flags as an engine reads them: the shell split every engine's lint starts from, and
the chain-shape check that SGLang-style flags (SGLang, eaglewire) share. Pure functions."""

from __future__ import annotations

import json
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
    draft_path: str | None = None  # the draft the flags load (a directory, or llama.cpp's GGUF), as written


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
    if topk == 1 and steps is not None and tokens is not None and tokens > steps + 1:
        out.problems.append((verdict, f"the flags capped the draft: --speculative-eagle-topk 1 with "
                             f"--speculative-num-steps {steps} drafts {steps} token{'s' if steps != 1 else ''} a "
                             f"round, not the {tokens - 1} that --speculative-num-draft-tokens {tokens} asks for "
                             f"({silently}, setting it to {steps + 1})",
                             f"--speculative-num-steps {tokens - 1} for a chain of {tokens - 1} (or "
                             f"--speculative-num-draft-tokens {steps + 1} to say what runs)"))
    elif topk == 1 and steps is not None and tokens is not None and tokens != steps + 1:
        out.problems.append((verdict, f"--speculative-eagle-topk 1 with --speculative-num-draft-tokens {tokens} != "
                             f"--speculative-num-steps {steps} + 1: {silently}",
                             f"--speculative-num-draft-tokens {steps + 1}"))
    return out


def positional(flags: str) -> list[str]:
    """The words that are neither a flag nor a flag's value (``vllm serve MODEL``: ``serve``, ``MODEL``)."""
    tokens, out, i = shlex.split(flags), [], 0
    while i < len(tokens):
        tok = tokens[i]
        if _is_flag(tok):
            if "=" not in tok and i + 1 < len(tokens) and not _is_flag(tokens[i + 1]):
                i += 1
        else:
            out.append(tok)
        i += 1
    return out


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        elif isinstance(v, list) and isinstance(into.get(k), list):
            into[k] += v
        else:
            into[k] = v


def parse_flexible(flags: str, aliases: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Launch flags as vLLM 0.33.0's ``FlexibleArgumentParser.parse_args`` (vllm/utils/argparse_utils.py)
    reads them -> ({canonical flag: value}, notes): underscores in a flag's name read as dashes
    (``--speculative_config``), ``aliases`` (``-sc`` -> ``--speculative-config``), dotted keys merged
    into one JSON object (``--speculative-config.method eagle3``, ``.key+ a,b`` appends a list;
    each value read as JSON, else as text) that, like argparse, replaces an earlier whole value."""
    args, notes = parse_flags(flags), []
    out: dict[str, Any] = {}
    dotted: dict[str, dict[str, Any]] = {}  # per spelling: vLLM merges ``-sc.x`` and ``--speculative-config.y`` apart
    for raw, value in args.items():
        name, _, rest = raw.partition(".")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if not rest:
            out[aliases.get(name, name)] = value
            continue
        append = rest.endswith("+")
        keys = rest.removesuffix("+").split(".")
        parsed = value.split(",") if append else _json_or_text(value)
        for key in reversed(keys):
            parsed = {key: parsed}
        _merge(dotted.setdefault(name, {}), parsed)
    for name, value in dotted.items():  # appended after every other flag, in order: the last one wins
        name = aliases.get(name, name)
        if name in out:
            notes.append(f"{name} is given more than once (whole, dotted or under an alias): vLLM parses the "
                         f"dotted keys last, so only {json.dumps(value)} counts")
        out[name] = value
    return out, notes


def resolve_abbreviation(flag: str, known: tuple[str, ...], aliases: dict[str, str]) -> str | list[str]:
    """``flag`` as argparse (``allow_abbrev``, its default) resolves it among ``known``: an alias or an
    exact name -> that name; a unique prefix -> the name it abbreviates; an ambiguous prefix -> the
    names it could mean (argparse refuses it); anything else -> itself."""
    flag = aliases.get(flag, flag)
    if flag in known or not flag.startswith("--"):
        return flag
    hits = [k for k in (*known, *aliases) if k.startswith(flag)]
    hits = sorted({aliases.get(h, h) for h in hits})
    return hits[0] if len(hits) == 1 else (hits or flag)


def template_kwargs_value(flag: str, value: Any) -> dict[str, Any]:
    """A launch flag's chat-template kwargs (a JSON object, or the object dotted keys built) as a dict;
    ValueError naming the flag when it is not one."""
    parsed = _json_or_text(value) if isinstance(value, str) else value
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} {value!r} is not a JSON object; the engine refuses it at launch (give e.g. "
                         f"{flag} '{{\"enable_thinking\": false}}')")
    return parsed
