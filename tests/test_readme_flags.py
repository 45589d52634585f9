"""Every flag the README and docs/*.md give an eaglewire command exists on that command's parser."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `eaglewire CMD`, `python -m eaglewire.cli CMD`, `torchrun ... -m eaglewire.cli CMD`
COMMAND = re.compile(r"(?:^|[\s(/])(?:eaglewire|-m eaglewire\.cli)((?:\s+(?:-v|--verbose|--threads\s+\S+))*)\s+([a-z][a-z-]*)\b(.*)")
SEPARATORS = re.compile(r"&&|\|\||[;|>`]|\s#")


def snippets(text: str) -> list[str]:
    """Shell text in a markdown file: code block lines (backslash continuations joined) and inline code."""
    out, block = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block = []
            else:
                out += "\n".join(block).replace("\\\n", " ").splitlines()
                block = None
            continue
        if block is not None:
            block.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return out + re.findall(r"`([^`\n]+)`", prose)


def commands(snippet: str, names: frozenset[str] = frozenset()) -> list[tuple[str, list[str]]]:
    """(subcommand, its --flags) of every eaglewire command in a snippet; with ``names`` (the
    subcommands) also a snippet that starts with one followed by a flag (`doctor --stored`)."""
    found = []
    for part in SEPARATORS.split(snippet):
        m = COMMAND.search(part)
        if m:
            cmd, rest = m.group(2), m.group(3)
        elif (short := re.match(r"\s*([a-z][a-z-]*)\s+(--.*)", part)) and short.group(1) in names:
            cmd, rest = short.group(1), short.group(2)
        else:
            continue
        try:
            words = shlex.split(rest)
        except ValueError:  # an unbalanced quote in prose
            words = rest.split()
        flags = [w.split("=")[0] for w in words if w.startswith("--") and not re.search(r"\s", w)]
        found.append((cmd, flags))
    return found


def parser_options() -> dict[str, set[str]]:
    from eaglewire.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def documented() -> list[tuple[str, str, str]]:
    """(file, subcommand, flag) for every flag written after an eaglewire command."""
    out, names = [], frozenset(parser_options())
    for path in DOCS:
        for snippet in snippets(path.read_text()):
            for cmd, flags in commands(snippet, names):
                out += [(path.name, cmd, flag) for flag in flags]
    return out


def test_the_extractor_reads_blocks_continuations_and_inline_code():
    text = ("Run `eaglewire doctor --draft reference --stored` then\n```sh\neaglewire train --data d \\\n"
            "  --head-only  # a comment --not-a-flag\npython -m eaglewire.cli prepare --out x && ls --all\n```\n"
            "and `eaglewire doctor --engine vllm --engine-flags '--speculative-config {}'`.")
    text += " Then `doctor --stored --labels tokens`, not `ls --all`."
    got = [c for s in snippets(text) for c in commands(s, frozenset({"doctor", "train", "prepare"}))]
    assert ("train", ["--data", "--head-only"]) in got and ("prepare", ["--out"]) in got
    assert ("doctor", ["--draft", "--stored"]) in got and ("doctor", ["--engine", "--engine-flags"]) in got
    assert ("doctor", ["--stored", "--labels"]) in got and not any(c == "ls" for c, _ in got)
    assert len(documented()) > 50  # the docs do name flags: an extractor that finds none would pass vacuously


@pytest.mark.parametrize("doc,cmd,flag", sorted(set(documented())))
def test_every_documented_flag_exists(doc, cmd, flag):
    options = parser_options()
    if cmd not in options:
        pytest.fail(f"{doc}: `eaglewire {cmd}` is not a command (commands: {', '.join(sorted(options))})")
    assert flag in options[cmd], f"{doc}: `eaglewire {cmd}` has no {flag}"


def test_doctor_takes_allow_target_mismatch_as_the_readme_says(tmp_path):
    """README: an import from a config-only target records weights_sha256 unknown, and the doctor then
    needs --allow-target-mismatch weights_sha256: without it the identity check fails naming the flag."""
    import dataclasses

    import torch

    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.data.shards import ShardWriter
    from eaglewire.doctor import DoctorConfig, run_doctor
    from eaglewire.model.checkpoint import save_draft
    from eaglewire.model.draft import DraftConfig, Eagle3Draft
    from eaglewire.model.target import load_target
    from tiny import save_tiny_dir

    target_dir = save_tiny_dir(tmp_path / "target")
    target = load_target(str(target_dir), device="cpu")
    contract = HiddenStateContract(aux_boundaries=(2, 4, 5), target=dataclasses.replace(
        target.fingerprint, weights_sha256="unknown"))
    g = torch.Generator().manual_seed(0)
    with ShardWriter(tmp_path / "data", contract, source={"test": True}) as w:
        for i in range(4):
            w.add(f"s{i}", torch.randint(0, 256, (16,), generator=g), torch.arange(16) >= 2,
                  torch.randn(16, 3 * 64, generator=g), torch.randn(16, 64, generator=g))
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=3, draft_vocab_size=256, vocab_size=256))
    save_draft(tmp_path / "draft", draft, contract)
    common = dict(draft=str(tmp_path / "draft"), target=str(target_dir), data=str(tmp_path / "data"), stored=True,
                  include_training=True, min_tokens=10, skip_label_check=True)
    refused = next(c for c in run_doctor(DoctorConfig(**common)).checks if c.name == "identity")
    assert refused.verdict == "fail" and "--allow-target-mismatch weights_sha256" in refused.fix
    allowed = next(c for c in run_doctor(DoctorConfig(**common, allow_target_mismatch=["weights_sha256"])).checks
                   if c.name == "identity")
    assert allowed.verdict == "warn" and "allowed by --allow-target-mismatch" in allowed.evidence[0]
    options = parser_options()
    assert "--allow-target-mismatch" in options["doctor"]
