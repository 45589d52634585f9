"""How llama.cpp is configured for the machine that builds it, and the record left beside the build.

ggml's CMake (``ggml/CMakeLists.txt`` and ``ggml/src/ggml-cpu/CMakeLists.txt`` at build 11434)
offers ``GGML_NATIVE`` (``-march=native``) or, with it off, one option per x86 extension, each
adding its ``-m`` flag to the ggml-cpu target only. ``-march=native`` on a CPU with AMX compiles
ggml's AMX kernels (``ggml-cpu/amx/``, used for Q4_0/Q4_1/Q8_0 and K-quant weights), and their
tile instructions trap (SIGILL, ``tilezero``) in llama-server's worker threads on Linux: the
XTILEDATA permission is asked for once (``ggml_amx_init``), not per thread (llama.cpp PR #26954;
seen on an Intel Xeon with AMX, eaglewire issue 38). So on x86 eaglewire passes the CPU's own
extensions, read from ``/proc/cpuinfo``, as ggml's options, with AMX off; on other architectures
``GGML_NATIVE``. The choice is a pure function of the CPU's flags, so the same kind of machine
always gets the same build, and a build whose record differs from it is rebuilt.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from eaglewire.core.errors import read_json_object
from eaglewire.core.fileio import atomic_write_json

COMMON_OPTIONS = {"CMAKE_BUILD_TYPE": "Release", "LLAMA_CURL": "OFF", "LLAMA_BUILD_TESTS": "OFF"}

# ggml's x86 options (GGML_NATIVE off) and the /proc/cpuinfo flags each one's -m flags need.
X86_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),  # one option, five -m flags
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
# Never compiled: their kernels trap in worker threads (see the module docstring).
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")

RECORD = "eaglewire-build.json"


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    """The cmake options for one machine and why."""

    options: dict[str, str]  # -D NAME=VALUE, in order
    reason: str

    def cmake_args(self) -> list[str]:
        return [f"-D{name}={value}" for name, value in self.options.items()]

    def isa(self) -> list[str]:
        return switched_on(self.options)


def switched_on(options: dict[str, str]) -> list[str]:
    """The ggml options switched on (the ISA a red run names)."""
    return [name for name, value in options.items() if name.startswith("GGML_") and value == "ON"]


def plan_for(cpu_flags: set[str], machine: str | None = None) -> BuildPlan:
    """The build configuration for a CPU with ``cpu_flags`` (``/proc/cpuinfo``) on ``machine``
    (``platform.machine()``)."""
    machine = (machine or platform.machine()).lower()
    if machine not in X86_MACHINES:
        return BuildPlan(options={**COMMON_OPTIONS, "GGML_NATIVE": "ON"},
                         reason=f"{machine}: ggml's -march/-mcpu=native (no AMX kernels outside x86)")
    options = {**COMMON_OPTIONS, "GGML_NATIVE": "OFF"}
    for name, needs in X86_OPTIONS.items():
        options[name] = "ON" if set(needs) <= cpu_flags else "OFF"
    for name in AMX_OPTIONS:
        options[name] = "OFF"
    has_amx = bool({"amx_tile", "amx_int8", "amx_bf16"} & cpu_flags)
    return BuildPlan(options=options,
                     reason="x86: this CPU's extensions from /proc/cpuinfo as ggml's options, AMX off"
                            + (" (this CPU has AMX; ggml's AMX kernels trap in llama-server's worker threads, "
                               "llama.cpp PR #26954)" if has_amx else ""))


@dataclass(frozen=True, kw_only=True)
class BuildRecord:
    """What ``build/eaglewire-build.json`` says: how the build was configured, on which CPU, and
    that the smoke run (a quantized GGUF served on several threads) passed there."""

    build: int
    options: dict[str, str]
    reason: str
    cpu: str
    cpu_flags: list[str]  # the SIMD flags that select kernels (core.machine.SIMD_FLAGS present)
    smoke: str  # what the smoke run served and answered

    def summary(self) -> str:
        isa = [name.removeprefix("GGML_") for name in switched_on(self.options)]
        return (f"llama.cpp build {self.build}: {' '.join(isa) or 'no ISA option'} | built on {self.cpu} | "
                f"{self.reason} | smoke: {self.smoke}")


def read_record(build_dir: Path) -> BuildRecord | None:
    """The record of the build in ``build_dir``, or None if it has none (or an unreadable one)."""
    try:
        return BuildRecord(**read_json_object(build_dir / RECORD, "rebuild"))
    except (OSError, ValueError, TypeError):  # missing, cut, or of another shape: no record
        return None


def write_record(build_dir: Path, record: BuildRecord) -> None:
    atomic_write_json(build_dir / RECORD, asdict(record))


def cmake_cache_options(build_dir: Path, names: list[str]) -> dict[str, str]:
    """``names``' values in ``build_dir/CMakeCache.txt`` (``NAME:TYPE=VALUE`` lines), those present."""
    try:
        lines = (build_dir / "CMakeCache.txt").read_text(errors="replace").splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        key, sep, value = line.partition("=")
        name = key.split(":")[0]
        if sep and name in names:
            found[name] = value
    return found


def rebuild_reason(build_dir: Path, plan: BuildPlan, build: int) -> str | None:
    """Why the built server in ``build_dir`` must be reconfigured for ``plan`` and rebuilt, or
    None when its record says it was configured so (its smoke run still decides)."""
    record = read_record(build_dir)
    if record is None:
        seen = cmake_cache_options(build_dir, ["GGML_NATIVE", *AMX_OPTIONS])
        how = ", ".join(f"{k}={v}" for k, v in seen.items()) or "an unknown configuration"
        return (f"it has no {RECORD} (built by an earlier eaglewire, {how}"
                + (": -march=native compiles the AMX kernels that trap" if seen.get("GGML_NATIVE") == "ON" else "")
                + ")")
    if record.build != build:
        return f"it is build {record.build}, the pin is {build}"
    differs = {k: (record.options.get(k), v) for k, v in plan.options.items() if record.options.get(k) != v}
    if differs:
        said = ", ".join(f"{k}={old} (this CPU: {new})" for k, (old, new) in differs.items())
        return f"it was configured on {record.cpu} with {said}"
    return None
