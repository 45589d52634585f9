"""The import layers of docs/architecture.md, checked on the source (``ast``, no imports run).

Every import counts, also those inside functions: a lazy import is still a dependency."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top: a module may import modules of its own layer or of the layers below it.
# A name is a module or a package prefix (the longest match wins).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("eaglewire", "eaglewire.core")),
    ("model", ("eaglewire.model",)),
    ("engines", ("eaglewire.engines",)),
    ("decode", ("eaglewire.decode",)),
    ("data", ("eaglewire.data",)),
    ("train", ("eaglewire.train",)),
    ("acceptance", ("eaglewire.acceptance", "eaglewire.concurrency")),
    ("commands", ("eaglewire.cli", "eaglewire.cli_settings", "eaglewire.quickstart", "eaglewire.serve",
                  "eaglewire.bench", "eaglewire.doctor", "eaglewire.tune")),
]
ENTRY_POINTS = {"eaglewire.cli": set(), "eaglewire.serve.app": {"eaglewire.cli"},
                "eaglewire.quickstart": {"eaglewire.cli"}}  # command -> the modules that may import it
# The commands, each a module or package prefix; modules of one command import each other freely.
COMMANDS = {"cli": ("eaglewire.cli", "eaglewire.cli_settings"), "serve": ("eaglewire.serve",),
            "quickstart": ("eaglewire.quickstart",), "bench": ("eaglewire.bench",),
            "doctor": ("eaglewire.doctor",), "tune": ("eaglewire.tune",)}
COMPOSERS = {"cli", "quickstart"}  # the commands that may import other commands: they compose them


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "eaglewire").rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The eaglewire modules ``name`` imports: ``from pkg import sub`` is an edge to pkg.sub when
    that is a module, else to pkg."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


# Known upward edges, each imported lazily inside a function (none now; a new one must be argued here).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {d for d in imports_of(name, path, set(mods)) if (name, d) not in KNOWN_UPWARD}
            for name, path in mods.items()}


def layer_of(name: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if name == prefix or name.startswith(prefix + ".")), default=None)
    if best is None or (best[0] == len("eaglewire") and name != "eaglewire"):
        raise AssertionError(f"{name} has no layer: add it to LAYERS here and to docs/architecture.md")
    return best[1]


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_of(name: str) -> str:
    """eaglewire.<pkg>: a module collapsed to its top-level package (a root module is its own)."""
    return ".".join(name.split(".")[:2])


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in edges.items():
        out.setdefault(package_of(m), set()).update(package_of(d) for d in deps if package_of(d) != package_of(m))
    return out


def command_of(name: str) -> str | None:
    return next((c for c, prefixes in COMMANDS.items()
                 if any(name == p or name.startswith(p + ".") for p in prefixes)), None)


def commands_importing_commands(edges: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({command_of(m)}) imports {d} ({command_of(d)})" for m, deps in sorted(edges.items())
            for d in sorted(deps) if command_of(m) not in COMPOSERS | {None} and command_of(d) not in {None, command_of(m)}]


def test_no_import_cycle_among_modules():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_among_packages():
    """No two packages import each other, not even through different modules."""
    cycle = find_cycle(package_graph(graph()))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_no_command_imports_another_command():
    """Commands call libraries; what two commands share lives in a library below them."""
    wrong = commands_importing_commands(graph())
    assert not wrong, "\n".join(wrong)


def test_every_module_imports_only_its_layer_or_below():
    wrong = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
             for m, deps in graph().items() for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not wrong, "\n".join(wrong)


def test_commands_are_imported_only_by_their_entry_point():
    wrong = [f"{m} imports {d}" for m, deps in graph().items() for d in deps
             if d in ENTRY_POINTS and m not in ENTRY_POINTS[d]]
    assert not wrong, "\n".join(wrong)


def test_decode_does_not_import_data():
    # data/regenerate drives the batched decoder (data -> decode); the other way round is refused.
    wrong = [f"{m} imports {d}" for m, deps in graph().items() for d in deps
             if m.startswith("eaglewire.decode") and d.startswith("eaglewire.data")]
    assert not wrong, "\n".join(wrong)


# Inside engines/, three tiers. An *engine* is a module or package whose ``SPEC`` the registry lists (read from
# registry.py: the packages eaglewire, llamacpp, sglang, vllm; the import-only formats/eagle and formats/specforge).
# The modules *above* the engines import them to list, configure or detect them (ENGINES_ABOVE). Every other module of
# engines/ is *shared*, below every engine: the interface, export, the formats several engines read or write
# (formats/: eagle3_layout, dflash_layout, speculators_layout, zlab_layout, importing, model_file) and what a running
# server reports (serving/: served drafts, counts, metrics, sampling defaults, launch flags). An engine imports shared modules only,
# never another engine nor a module above, so no engine reaches another, directly or through a shared module.
ENGINES_ABOVE = {"eaglewire.engines", "eaglewire.engines.registry", "eaglewire.engines.command_settings",
                 "eaglewire.engines.formats.foreign_draft"}


def engine_modules() -> set[str]:
    """``eaglewire.engines.<name>`` of every engine the registry lists (its ``from ... import SPEC`` lines)."""
    tree = ast.parse((SRC / "eaglewire" / "engines" / "registry.py").read_text())
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and any(a.name == "SPEC" for a in node.names)}


def engine_of(name: str, engines: set[str]) -> str | None:
    return next((e for e in engines if name == e or name.startswith(e + ".")), None)


def engine_import_problems(edges: dict[str, set[str]], engines: set[str]) -> list[str]:
    """Each import that breaks the tiers above, with what to do instead."""
    out = []
    for m, deps in sorted(edges.items()):
        mine = engine_of(m, engines)
        shared = mine is None and m.startswith("eaglewire.engines.") and m not in ENGINES_ABOVE
        for d in sorted(deps):
            theirs = engine_of(d, engines)
            if mine and theirs and theirs != mine:
                out.append(f"{m} (engine {mine}) imports {d} (engine {theirs}): move what both need below them, "
                           "into a shared module of engines/ named for what it holds")
            elif mine and d in ENGINES_ABOVE:
                out.append(f"{m} (engine {mine}) imports {d}, which imports the engines: take it as an argument")
            elif shared and theirs:
                out.append(f"{m} (shared by the engines) imports {d} (engine {theirs}): an engine reaches "
                           "another through it; keep it below the engines")
    return out


def test_no_engine_imports_another_engine():
    engines = engine_modules()
    assert {e.rpartition(".")[2] for e in engines} >= {"sglang", "vllm", "llamacpp", "specforge"}
    for module in ENGINES_ABOVE:
        assert module in modules(), f"{module} is gone: drop it from ENGINES_ABOVE"
    wrong = engine_import_problems(graph(), engines)
    assert not wrong, "\n".join(wrong)


def outside_engine_imports(edges: dict[str, set[str]], engines: set[str]) -> list[str]:
    """Each import of an engine's own package by a module outside engines/: commands, the doctor and the rest reach
    an engine through its spec (``engines.get(name, Ability...)``), never by naming it."""
    return [f"{m} imports {d}: reach it through engines.get(...) and its spec's fields"
            for m, deps in sorted(edges.items()) if not m.startswith("eaglewire.engines")
            for d in sorted(deps) if engine_of(d, engines)]


def test_nothing_outside_engines_names_an_engine():
    wrong = outside_engine_imports(graph(), engine_modules())
    assert not wrong, "\n".join(wrong)
    seen = outside_engine_imports({"eaglewire.cli": {"eaglewire.engines.b", "eaglewire.engines"}},
                                  {"eaglewire.engines.b"})
    assert seen == ["eaglewire.cli imports eaglewire.engines.b: reach it through engines.get(...) and its spec's "
                    "fields"]


def test_the_engine_tiers_see_an_engine_importing_another():
    engines = {"eaglewire.engines.a", "eaglewire.engines.b"}
    edges = {"eaglewire.engines.a.export": {"eaglewire.engines.b", "eaglewire.engines.formats.eagle3_layout"},  # a -> b
             "eaglewire.engines.b": {"eaglewire.engines.b.readings", "eaglewire.engines.registry"},  # b -> above
             "eaglewire.engines.formats.eagle3_layout": {"eaglewire.engines.a.readings"},  # shared -> a
             "eaglewire.engines.registry": {"eaglewire.engines.a", "eaglewire.engines.b"}}  # above -> both: fine
    wrong = engine_import_problems(edges, engines)
    assert len(wrong) == 3
    assert wrong[0].startswith("eaglewire.engines.a.export (engine eaglewire.engines.a) imports eaglewire.engines.b "
                               "(engine eaglewire.engines.b): move what both need below them")
    assert wrong[1].startswith("eaglewire.engines.b (engine eaglewire.engines.b) imports eaglewire.engines.registry")
    assert wrong[2].startswith("eaglewire.engines.formats.eagle3_layout (shared by the engines) imports eaglewire.engines.a.readings")


def test_the_checks_see_what_they_check(tmp_path, monkeypatch):
    """The graph reads function-level and submodule imports, and a cycle is reported."""
    g = graph()
    assert "eaglewire.decode.load" in g["eaglewire.serve.app"]  # module level
    assert "eaglewire.quickstart" in g["eaglewire.cli"]  # inside a function
    assert "eaglewire.engines.vllm.installation" in g["eaglewire.engines.vllm.setup"]  # from package import module
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # two packages importing each other through different modules is a package cycle, not a module cycle
    modules_only = {"eaglewire.tune.simulate": {"eaglewire.doctor.replay"}, "eaglewire.doctor.replay": set(),
                    "eaglewire.doctor.doctor_command": {"eaglewire.tune.tune_command"}, "eaglewire.tune.tune_command": set()}
    assert find_cycle(modules_only) is None
    assert find_cycle(package_graph(modules_only)) == ["eaglewire.doctor", "eaglewire.tune", "eaglewire.doctor"]
    assert commands_importing_commands(modules_only) == [
        "eaglewire.doctor.doctor_command (doctor) imports eaglewire.tune.tune_command (tune)",
        "eaglewire.tune.simulate (tune) imports eaglewire.doctor.replay (doctor)"]
    assert commands_importing_commands({"eaglewire.quickstart": {"eaglewire.tune.tune_command"},
                                        "eaglewire.bench.bench_report": {"eaglewire.bench.bench_command"}}) == []
    with pytest.raises(AssertionError, match="eaglewire.nowhere has no layer"):
        layer_of("eaglewire.nowhere")


def test_docs_draw_the_same_layers():
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    drawing = doc.split("## Layers", 1)[1].split("```")[1]
    rows: dict[str, str] = {}
    names = {layer for layer, _ in LAYERS}
    for line in drawing.splitlines():
        words = line.split()
        if words and words[0] in names:
            current = words[0]
            rows[current] = line
        elif words and words[0] != "│":
            rows[current] += " " + line  # a continuation of the layer above
    for layer, prefixes in LAYERS:
        assert layer in rows, f"docs/architecture.md draws no layer {layer!r}"
        for prefix in prefixes:
            path = SRC / prefix.replace(".", "/")
            if prefix == "eaglewire" or not (path.is_dir() or path.with_suffix(".py").exists()):
                continue
            short = prefix.removeprefix("eaglewire.").replace(".", "/") + ("/" if path.is_dir() else "")
            words = rows[layer].replace(",", " ").replace("·", " ").split()
            assert short in words, f"docs/architecture.md does not draw {short} in layer {layer!r}"


ROOT_MODULES = {"__init__", "cli", "cli_settings", "quickstart"}  # the entry: cli composes the commands


def test_the_folders_show_the_layers():
    """The package root holds only the entry; every other module sits in a folder, and every folder
    in exactly one layer (so a module's path says its layer)."""
    root = {p.stem for p in (SRC / "eaglewire").glob("*.py")}
    assert root <= ROOT_MODULES, f"modules at the root: {sorted(root - ROOT_MODULES)}: put them in their layer's folder"
    for package in sorted(p.name for p in (SRC / "eaglewire").iterdir() if (p / "__init__.py").exists()):
        inside = {layer_of(m) for m in modules() if m == f"eaglewire.{package}" or m.startswith(f"eaglewire.{package}.")}
        assert len(inside) == 1, f"eaglewire/{package}/ spans layers {sorted(LAYERS[i][0] for i in inside)}"
