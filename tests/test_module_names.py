"""One home per concept: no module name repeats across packages (docs/architecture.md, issue 72).

A newcomer who greps for ``concurrency.py`` or ``run.py`` should find one file. The exception is the engine
packages (``engines/<engine>/``, each ending in ``SPEC = EngineSpec(...)``): their parallel files (``readings.py``,
``server.py``, ``installation.py``) say the same thing of different engines, so they repeat among themselves, but
never take a name a module outside them has."""

from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "eaglewire"


def engine_packages(root: Path) -> set[Path]:
    """The folders under engines/ whose ``__init__.py`` assembles an engine's ``SPEC``."""
    return {p.parent for p in (root / "engines").glob("*/__init__.py") if "SPEC = EngineSpec(" in p.read_text()}


def named_modules(root: Path) -> list[tuple[str, Path, bool]]:
    """(name, path, in an engine package) for every module and package below ``root`` (``__init__`` files are
    their package's name)."""
    engines = engine_packages(root)
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if path.name == "__init__.py":
            if rel.parent == Path("."):
                continue
            name, where = rel.parent.name, path.parent
        else:
            name, where = path.stem, path
        out.append((name, rel, any(e in where.parents for e in engines)))
    return out


def repeated(modules: list[tuple[str, Path, bool]]) -> list[str]:
    """Each name that repeats, unless every place holding it is inside an engine package."""
    by_name: dict[str, list[tuple[Path, bool]]] = defaultdict(list)
    for name, rel, in_engine in modules:
        by_name[name].append((rel, in_engine))
    return [f"{name}: " + ", ".join(str(rel) for rel, _ in places) for name, places in sorted(by_name.items())
            if len(places) > 1 and not all(in_engine for _, in_engine in places)]


def test_no_module_name_repeats_outside_the_engine_packages():
    wrong = repeated(named_modules(SRC))
    assert not wrong, ("module names repeat; name each for what it holds (engine packages' parallel files "
                       "excepted):\n" + "\n".join(wrong))


def test_the_engine_packages_are_found():
    assert {p.name for p in engine_packages(SRC)} >= {"eaglewire", "llamacpp", "sglang", "vllm"}


def test_the_rule_sees_a_repeat(tmp_path):
    for rel in ("engines/vllm/readings.py", "engines/sglang/readings.py", "doctor/run.py", "bench/run.py",
                "engines/llamacpp/server.py", "serve/server.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    for engine in ("vllm", "sglang", "llamacpp"):
        (tmp_path / "engines" / engine / "__init__.py").write_text("SPEC = EngineSpec(name='x')\n")
    wrong = repeated(named_modules(tmp_path))
    assert [w.split(":")[0] for w in wrong] == ["run", "server"]  # readings.py repeats only among engines: allowed
