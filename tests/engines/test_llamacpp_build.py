"""llama.cpp's build for the machine that builds it: the cmake options per CPU kind (checked against
ggml's own CMake), the record beside the build, the smoke run that proves it (a faked SIGILL, as
ggml's AMX kernels trap on an Intel Xeon with AMX), and the rebuild of a tree configured otherwise."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from eaglewire.engines import llamacpp as engine
from eaglewire.engines.llamacpp import build_config, installation, smoke
from fake_llamacpp import SERVING, TRAPS, fake_server

# /proc/cpuinfo flags of the three kinds of machine this project has met (the parts that matter)
BASE = {"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"}
AVX512 = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni"}
AMD_AVX2 = BASE
AMD_AVX512 = BASE | AVX512 | {"avx512_bf16"}
INTEL_AMX = BASE | AVX512 | {"avx512_bf16", "avx512_fp16", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile"}

# ------------------------------------------------------------------ the plan per CPU kind

@pytest.mark.parametrize("flags", [AMD_AVX2, AMD_AVX512, INTEL_AMX], ids=["amd-avx2", "amd-avx512", "intel-amx"])
def test_x86_builds_take_the_cpus_own_extensions_and_never_amx(flags):
    plan = build_config.plan_for(flags, "x86_64")
    assert plan.options["GGML_NATIVE"] == "OFF"  # -march=native would compile AMX on the AMX kind
    assert all(plan.options[name] == "OFF" for name in build_config.AMX_OPTIONS)
    assert plan.options["GGML_AVX2"] == "ON"
    assert (plan.options["GGML_AVX512"] == "ON") == ("avx512f" in flags)
    assert (plan.options["GGML_AVX512_BF16"] == "ON") == ("avx512_bf16" in flags)
    assert (plan.options["GGML_AVX_VNNI"] == "ON") == ("avx_vnni" in flags)
    assert ("PR #26954" in plan.reason) == ("amx_tile" in flags)  # the record says why where it matters


def test_avx512_needs_all_five_of_ggmls_flags():
    assert build_config.plan_for(BASE | {"avx512f", "avx512bw"}, "x86_64").options["GGML_AVX512"] == "OFF"


def test_other_architectures_build_native():
    plan = build_config.plan_for({"asimd", "sve"}, "aarch64")
    assert plan.options["GGML_NATIVE"] == "ON" and not any(n.startswith("GGML_AVX") for n in plan.options)


def test_the_plan_names_every_x86_option_of_the_pinned_ggml():
    """Every ISA option ggml-cpu's CMake turns into -m flags (GGML_NATIVE off) is decided by the plan,
    and every option the plan passes is one ggml declares: a new pin with a new extension fails here."""
    tree = engine.find_tree()
    if tree is None:
        pytest.skip(f"the llama.cpp tree is not unpacked: {engine.INSTALL_HINT}")
    cpu_cmake = (tree / "ggml" / "src" / "ggml-cpu" / "CMakeLists.txt").read_text()
    x86 = cpu_cmake.split('GGML_SYSTEM_ARCH STREQUAL "x86"')[1].split("GGML_SYSTEM_ARCH STREQUAL")[0]
    non_native = x86.split("if (GGML_NATIVE)\n                list(APPEND ARCH_FLAGS -march=native)")[1]
    import re

    in_ggml = set(re.findall(r"if \((GGML_[A-Z0-9_]+)\)", non_native.split("if (GGML_BACKEND_DL)")[0]))
    decided = set(build_config.X86_OPTIONS) | set(build_config.AMX_OPTIONS)
    assert in_ggml == decided
    declared = set(re.findall(r"option\((GGML_[A-Z0-9_]+)", (tree / "ggml" / "CMakeLists.txt").read_text()))
    assert set(build_config.plan_for(INTEL_AMX, "x86_64").options) - set(build_config.COMMON_OPTIONS) <= declared


@pytest.mark.llamacpp
def test_cmake_compiles_no_amx_for_the_amx_kind(tmp_path):
    """ggml's own CMake, configured with the plan for the Intel AMX kind: the ggml-cpu target gets
    the AVX-512 flags and no -mamx-* and no -march=native (which on that CPU turns AMX on)."""
    tree = engine.find_tree()
    if tree is None or shutil.which("cmake") is None:
        pytest.skip(f"needs cmake and the llama.cpp tree: {engine.INSTALL_HINT}")
    plan = build_config.plan_for(INTEL_AMX, "x86_64")
    out = subprocess.run(["cmake", "-S", str(tree), "-B", str(tmp_path), *plan.cmake_args()],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(s for s in out.stdout.splitlines() if "Adding CPU backend variant ggml-cpu" in s)
    assert "-mavx512bf16" in line and "-mavxvnni" in line
    assert "-mamx" not in line and "-march=native" not in line and "AMX" not in line


# ------------------------------------------------------------------ the record and the rebuild decision

def record_for(plan, **kw):
    return build_config.BuildRecord(**{"build": engine.BUILD, "options": plan.options, "reason": plan.reason,
                                       "cpu": "AMD EPYC", "cpu_flags": [], "smoke": "ok", **kw})


def test_a_build_recorded_for_this_plan_is_kept(tmp_path):
    plan = build_config.plan_for(AMD_AVX512, "x86_64")
    build_config.write_record(tmp_path, record_for(plan))
    assert build_config.read_record(tmp_path) == record_for(plan)
    assert build_config.rebuild_reason(tmp_path, plan, engine.BUILD) is None


def test_a_native_build_of_an_earlier_eaglewire_is_rebuilt_naming_its_configuration(tmp_path):
    (tmp_path / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=ON\nGGML_AMX_INT8:BOOL=OFF\nOTHER:STRING=x\n")
    reason = build_config.rebuild_reason(tmp_path, build_config.plan_for(INTEL_AMX, "x86_64"), engine.BUILD)
    assert "no eaglewire-build.json" in reason and "GGML_NATIVE=ON" in reason and "AMX" in reason


def test_a_build_for_another_cpu_is_rebuilt_naming_the_difference(tmp_path):
    build_config.write_record(tmp_path, record_for(build_config.plan_for(AMD_AVX512, "x86_64")))
    reason = build_config.rebuild_reason(tmp_path, build_config.plan_for(AMD_AVX2, "x86_64"), engine.BUILD)
    assert "GGML_AVX512=ON (this CPU: OFF)" in reason and "AMD EPYC" in reason
    assert "is build 1" in build_config.rebuild_reason(
        tmp_path, build_config.plan_for(AMD_AVX512, "x86_64"), 1)


def test_an_unreadable_record_counts_as_none(tmp_path):
    (tmp_path / build_config.RECORD).write_text("{not json")
    assert build_config.read_record(tmp_path) is None


# ------------------------------------------------------------------ the smoke run

def test_the_smoke_gguf_is_q8_0_with_dimensions_ggmls_quantized_kernels_take(tmp_path):
    import gguf

    reader = gguf.GGUFReader(smoke.write_smoke_gguf(tmp_path / "s.gguf"))
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert matrices and all(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in matrices)
    assert all(int(d) % 32 == 0 for t in matrices for d in t.shape)


def test_a_server_that_traps_fails_the_smoke_run_naming_the_signal(tmp_path):
    binary = fake_server(tmp_path / "llama-server", TRAPS)
    with pytest.raises(smoke.SmokeFailed, match=r"SIGILL(.|\n)*AMX(.|\n)*CPU_REPACK"):
        smoke.smoke_run(binary, log_path=tmp_path / "smoke.log")


def test_a_serving_server_passes_the_smoke_run(tmp_path):
    said = smoke.smoke_run(fake_server(tmp_path / "llama-server", SERVING))
    assert "Q8_0" in said and f"{smoke.SMOKE_NEW_TOKENS} tokens" in said


def test_exit_causes_read_as_words():
    from eaglewire.engines.llamacpp.failure import exit_cause

    assert exit_cause(-4).startswith("SIGILL") and exit_cause(-11) == "SIGSEGV"
    assert exit_cause(3) == "exit status 3"


def test_a_server_that_traps_at_start_says_how_to_rebuild_it(tmp_path):
    """Any command, not only install: a cached build from an earlier eaglewire that traps names the fix."""
    server = engine.LlamaServer(fake_server(tmp_path / "llama-server", TRAPS), engine.ServerConfig(model=tmp_path / "t"),
                                log_path=tmp_path / "s.log", startup_timeout=60)
    with pytest.raises(engine.LlamaCppError, match=r"exited with -4 \(SIGILL.*engines install llamacpp"):
        with server:
            pass


@pytest.mark.llamacpp
def test_the_installed_server_passes_the_smoke_run_and_was_built_for_this_cpu(tmp_path):
    from eaglewire.core.machine import cpu

    server = engine.find_server()
    if server is None:
        pytest.skip(f"llama-server is not installed: {engine.INSTALL_HINT}")
    assert "Q8_0" in smoke.smoke_run(server, log_path=tmp_path / "smoke.log")
    record = engine.server_record(server)
    if record is not None:  # eaglewire's own cached build
        assert record.options == build_config.plan_for(cpu()[1]).options


# ------------------------------------------------------------------ install: prove, record, rebuild

@pytest.fixture()
def cached_tree(tmp_path, monkeypatch):
    """An unpacked tree in a fresh cache, and a CPU of the AMX kind."""
    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(installation, "cpu", lambda: ("Intel Xeon (test)", INTEL_AMX))
    root = engine.source_dir()
    (root / "gguf-py").mkdir(parents=True)
    (root / engine.CONVERTER).write_text("")
    return root


def fake_builder(script: str, calls: list):
    def build(tree, plan, *, jobs=None, progress=None):
        calls.append(plan)
        return fake_server(engine.built_server(tree), script)
    return build


def test_install_rebuilds_a_native_tree_then_keeps_it(cached_tree, monkeypatch):
    fake_server(engine.built_server(cached_tree), TRAPS)  # an earlier eaglewire's -march=native build
    (cached_tree / "build" / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=ON\n")
    calls, stages = [], []
    monkeypatch.setattr(installation, "build_server", fake_builder(SERVING, calls))
    found = engine.install(progress=lambda stage, percent: stages.append(stage))
    assert found.how == "rebuilt" and len(calls) == 1 and calls[0].options["GGML_AMX_INT8"] == "OFF"
    assert any("rebuilding" in s and "GGML_NATIVE=ON" in s for s in stages)
    assert found.record == engine.server_record(found.server) and "Q8_0" in found.record.smoke
    assert found.record.cpu == "Intel Xeon (test)"
    assert any(name == "configured" and "GGML_AMX_TILE=OFF" in value for name, value in found.rows())
    assert engine.install().how == "cached" and len(calls) == 1  # recorded: not rebuilt again


def test_install_refuses_a_build_that_dies_in_its_smoke_run(cached_tree, monkeypatch):
    monkeypatch.setattr(installation, "build_server", fake_builder(TRAPS, []))
    with pytest.raises(engine.LlamaCppError, match=r"SIGILL(.|\n)*does not run on this machine \(Intel Xeon"):
        engine.install()
    assert engine.server_record(engine.built_server(cached_tree)) is None  # not declared installed


def test_a_trapping_server_on_path_is_refused_saying_how_to_build_one(cached_tree, tmp_path, monkeypatch):
    fake_server(tmp_path / "empty" / "llama-server", TRAPS)
    with pytest.raises(engine.LlamaCppError, match="SIGILL(.|\n)*pass --build"):
        engine.install()


def test_engines_which_prints_the_recorded_configuration(cached_tree, monkeypatch, capsys):
    from eaglewire.cli import main

    monkeypatch.setattr(installation, "build_server", fake_builder(SERVING, []))
    engine.install()
    assert main(["engines", "which", "llamacpp"]) == 0
    out = capsys.readouterr().out
    assert "GGML_NATIVE=OFF" in out and "Intel Xeon (test)" in out and "AMX off" in out
    assert json.loads((cached_tree / "build" / build_config.RECORD).read_text())["options"]["GGML_AMX_BF16"] == "OFF"
