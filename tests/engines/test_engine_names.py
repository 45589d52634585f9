"""Engine names are spelled in the engines package only: elsewhere code asks the registry
(``engines.get(name).can(...)``, ``engines.names(capability)``) or uses an engine module's
``NAME``, so adding or renaming an engine is one module and one registry line.

The scan reads the source with ``ast``: every string constant equal to an engine name or alias
(``eaglewire``, the project's own name and its engine, is left out: it also names loggers,
commands and the export record key). Help texts and messages that mention engines inside a
sentence are not constants equal to a name and pass.
"""

import ast
from pathlib import Path

from eaglewire import engines
from eaglewire.engines import Ability

SRC = Path(__file__).resolve().parents[2] / "src" / "eaglewire"

# Files outside engines/ that may spell the names, and why.
ALLOWED = {
    # other tools' *capture* layouts for `import-data` (vLLM's connector files, speculators' hs_{i},
    # SpecForge's .ckpt): data formats named after the tool that wrote them, not serving engines
    "data/foreign.py",
    "data/import_data.py",
}


def engine_names() -> set[str]:
    return set(engines.names()) - {"eaglewire"}


def spelled_names(root: Path) -> list[str]:
    """``path:line: 'name'`` for every string constant equal to an engine name outside engines/
    and ALLOWED."""
    wanted, found = engine_names(), []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("engines/") or rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in wanted:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_engine_names_live_in_the_engines_package():
    found = spelled_names(SRC)
    assert not found, ("engine names spelled outside src/eaglewire/engines (ask the registry, or use the "
                       "engine module's NAME):\n" + "\n".join(found))


def test_the_scan_sees_a_name(tmp_path):
    """The scan flags a literal in any file outside engines/, and not inside it or in a sentence."""
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "x.py").write_text('E = "vllm"\n')
    (tmp_path / "bench.py").write_text('HELP = "runs on vllm"\nif engine == "llamacpp":\n    pass\n')
    assert spelled_names(tmp_path) == ["bench.py:2: 'llamacpp'"]


def test_allowed_files_exist_and_are_few():
    assert len(ALLOWED) <= 3
    for rel in ALLOWED:
        assert (SRC / rel).is_file(), f"{rel} is gone: drop it from ALLOWED"


def test_registry_names_resolve_aliases():
    assert engines.get("speculators") is engines.get("vllm")
    assert engines.canonical("speculators") == "vllm"
    assert engines.names(Ability.EXPORT) == ("sglang", "vllm", "speculators", "specforge", "zlab", "llamacpp")
    assert "speculators" not in engines.names(Ability.EXPORT, aliases=False)
    try:
        engines.get("tensorrt")
    except ValueError as e:
        assert "'tensorrt' is not one of eaglewire, sglang, vllm, speculators" in str(e)
    else:
        raise AssertionError("an unknown engine must be refused")


ENGINE_PACKAGES = {f"eaglewire.engines.{e.name}" for e in engines.ENGINES if e.name != "eaglewire"} | {
    "eaglewire.engines.eaglewire"}
IMPORTS_ALLOWED = {"cli.py"}  # the CLI's contract command shows SGLang's and vLLM's versions and model files


def engine_imports(root: Path) -> list[str]:
    """``path:line: module`` for every import of one engine's package outside engines/ (and the CLI): the house
    talks to engines through the registry's types only."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("engines/") or rel in IMPORTS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            hit = [n for n in names if any(n == p or n.startswith(p + ".") for p in ENGINE_PACKAGES)]
            if hit:
                found.append(f"{rel}:{node.lineno}: {hit[0]}")
    return found


def test_no_engine_code_outside_the_engines_package():
    found = engine_imports(SRC)
    assert not found, ("engine packages imported outside src/eaglewire/engines (talk to engines.get(name)'s spec "
                       "instead):\n" + "\n".join(found))


def test_the_import_scan_sees_an_engine_import(tmp_path):
    (tmp_path / "bench.py").write_text("from eaglewire.engines.llamacpp.server import LlamaServer\n"
                                       "from eaglewire.engines import interface\nimport eaglewire.engines.vllm\n")
    assert engine_imports(tmp_path) == ["bench.py:1: eaglewire.engines.llamacpp.server",
                                        "bench.py:3: eaglewire.engines.vllm"]
