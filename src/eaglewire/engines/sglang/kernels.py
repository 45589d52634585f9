"""SGLang's CPU kernels (``torch.ops.sgl_kernel.*_cpu``), built here from the pinned source.

No registry ships them: the ``sglang-kernel`` wheels that ``sglang`` pins are CUDA builds. Their source at a pinned
commit lies in the shared ``third_party/`` directory (``KERNEL_ARCHIVE``, Apache-2.0) and is a build input only:
unpacked into the install's cache, changed by the named patches below, compiled with torch's own extension
builder against the venv's torch, and loaded by ``sgl_kernel`` as its ``common_ops``.

Pure parts (what to change, how to compile) are functions of text and paths, tested without a compiler; ``build``
runs the compiler in the SGLang venv's python.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

KERNEL_COMMIT = "3b3810d4f34d9450e38f6a961704649b1d7be4d7"  # SGLang main of 2026-07-24 (sgl-kernel 0.4.5)
KERNEL_ARCHIVE = "sgl-kernel-cpu-3b3810d.tar.gz"
KERNEL_SHA256 = "38d877b1afd95044b87605879eacf90b45dd2cb055b41bd5e4e3a20fe472d27c"
KERNEL_GIT = "https://github.com/sgl-project/sglang"  # users with a network: --kernel-source GIT_URL@commit
ADAPTER = Path(__file__).with_name("kernel_args.cpp")  # eaglewire's own: 0.5.23's argument lists
# SGLang's CMake flags for x86_64 (csrc/cpu/CMakeLists.txt): AMX only to compile, the ops check for it at run time
CFLAGS = ("-O3", "-Wno-unknown-pragmas", "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile",
          "-mamx-bf16", "-mamx-int8", "-fopenmp", "-DSGLANG_CPU_FP8_CVT_FTZ")
LDFLAGS = ("-lnuma", "-fopenmp")
# what the compiled code executes unconditionally (-march=x86-64-v4 plus avx512_bf16): /proc/cpuinfo's names
NEEDED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni")


class KernelError(RuntimeError):
    """The kernels' source is missing or does not match, a patch no longer applies, or the build failed."""


# ------------------------------------------------------------------ the machine

def missing_cpu_flags(cpuinfo: str) -> list[str]:
    """The instruction sets the build needs that ``cpuinfo`` (``/proc/cpuinfo``'s text) lacks, in order."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    return [f for f in NEEDED_FLAGS if f not in flags]


def cpu_refusal(cpuinfo_path: Path = Path("/proc/cpuinfo")) -> str | None:
    """Why SGLang's CPU kernels cannot run on this CPU (None where they can)."""
    try:
        missing = missing_cpu_flags(cpuinfo_path.read_text())
    except OSError:
        return None  # not Linux on x86: the build says what fails
    if not missing:
        return None
    return (f"SGLang's CPU kernels are compiled for AVX-512 with bf16 (x86-64-v4, avx512_bf16, as SGLang's own "
            f"CMake does) and this CPU lacks {', '.join(missing)}: SGLang's EAGLE-3 path on a CPU needs them")


# ------------------------------------------------------------------ the source

def archive_candidates(repo_root: Path) -> list[Path]:
    """Where the pinned archive is looked for: ``$EAGLEWIRE_THIRD_PARTY``, then ``shared/third_party`` beside the
    checkout (``../shared/third_party``) or beside any directory above it."""
    dirs = [Path(os.environ["EAGLEWIRE_THIRD_PARTY"])] if os.environ.get("EAGLEWIRE_THIRD_PARTY") else []
    dirs += [repo_root / "shared" / "third_party"]
    dirs += [parent / "shared" / "third_party" for parent in repo_root.parents]
    return [d / KERNEL_ARCHIVE for d in dirs]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class KernelSource:
    """Where the kernels' source came from: the pinned archive (checked), a directory, or a git checkout."""

    root: Path  # the ``sgl-kernel`` directory (holds ``csrc/cpu``)
    origin: str  # what ``engines which`` prints


def unpack(archive: Path, dest: Path) -> Path:
    """The pinned archive, its checksum checked, unpacked into ``dest``: the ``sgl-kernel`` directory."""
    got = sha256(archive)
    if got != KERNEL_SHA256:
        raise KernelError(f"{archive} is not the pinned kernel source (sha256 {got}, expected {KERNEL_SHA256}): "
                          f"restore it, or pass --kernel-source DIR|GIT_URL")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    roots = [p.parent.parent for p in dest.glob("**/csrc/cpu") if p.is_dir()]
    if not roots:
        raise KernelError(f"{archive} holds no csrc/cpu")
    return roots[0]


def fetch_git(url: str, dest: Path, log: Path) -> Path:
    """``URL[@commit]`` cloned into ``dest`` (sparse: ``sgl-kernel`` only): its ``sgl-kernel`` directory."""
    repo, _, commit = url.partition("@")
    commit = commit or KERNEL_COMMIT
    if dest.exists():
        shutil.rmtree(dest)
    with open(log, "a") as out:
        for cmd in (["git", "clone", "--filter=blob:none", "--no-checkout", repo, str(dest)],
                    ["git", "-C", str(dest), "sparse-checkout", "set", "sgl-kernel"],
                    ["git", "-C", str(dest), "checkout", commit]):
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise KernelError(f"{' '.join(cmd)} failed; log {log}")
    return dest / "sgl-kernel"


def resolve_source(given: str | None, repo_root: Path, work: Path, log: Path) -> KernelSource:
    """The kernels' source: ``given`` (an archive, a ``sgl-kernel`` directory or a git URL) or the pinned archive,
    copied or unpacked into ``work`` (the patches change the copy, never the user's files)."""
    if given and (given.startswith(("http://", "https://", "git@")) or given.endswith(".git")):
        return KernelSource(fetch_git(given, work / "git", log), f"git {given}")
    if given:
        path = Path(given).expanduser()
        if path.is_file():
            return KernelSource(unpack(path, work / "src"), f"{path} (sha256 checked)")
        if not (path / "csrc" / "cpu").is_dir():
            raise KernelError(f"--kernel-source {given}: neither the pinned archive nor a directory holding "
                              f"csrc/cpu (SGLang's sgl-kernel directory)")
        dest = work / "src" / "sgl-kernel"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(path, dest)
        return KernelSource(dest, str(path))
    for archive in archive_candidates(repo_root):
        if archive.is_file():
            return KernelSource(unpack(archive, work / "src"), f"{archive} (commit {KERNEL_COMMIT[:7]}, sha256 checked)")
    looked = ", ".join(str(p.parent) for p in archive_candidates(repo_root))
    raise KernelError(f"SGLang's CPU kernel source ({KERNEL_ARCHIVE}) is not in {looked}: pass --kernel-source "
                      f"with the archive, a sgl-kernel directory, or {KERNEL_GIT}@{KERNEL_COMMIT[:7]}")


# ------------------------------------------------------------------ the changes

@dataclass(frozen=True)
class Patch:
    """One named change to a file: ``old`` (a regular expression matching exactly once) is replaced by ``new``
    (a ``re.sub`` template: ``\\g<name>`` keeps a group); ``done`` matches only once the change is in."""

    name: str
    file: str  # relative to the root it is applied under
    old: str
    new: str
    done: str
    why: str


def apply(root: Path, patch: Patch) -> str:
    """``patch`` applied under ``root``; what ``engines which`` says of it. Applying twice changes nothing; a
    file whose text no longer matches (another release) is a KernelError naming the patch."""
    path = root / patch.file
    text = path.read_text()
    if re.search(patch.done, text):
        return f"{patch.name}: already applied ({patch.file})"
    hits = len(re.findall(patch.old, text))
    if hits != 1:
        raise KernelError(f"patch {patch.name!r} expects one match in {path}, found {hits}: this is not the release "
                          f"eaglewire adapts ({patch.why})")
    changed = re.sub(patch.old, patch.new, text, count=1)
    if not re.search(patch.done, changed):
        raise KernelError(f"patch {patch.name!r} left {path} without its change")
    path.write_text(changed)
    return f"{patch.name}: {patch.why} ({patch.file})"


_DECODE_SCHEMA = (
    '"decode_attention_cpu(Tensor query, Tensor k_cache, Tensor v_cahce, float key_scale, float value_scale, '
    'Tensor(a!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, '
    'Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, '
    'int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"')
_EXTEND_SCHEMA = (
    '"extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, '
    'Tensor k_buffer, Tensor v_buffer, float key_scale, float value_scale, Tensor req_to_token, '
    'Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, '
    'float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, '
    'Tensor? sinks, Tensor? tree_mask=None, bool is_causal=True) -> ()"')
_DECLARATIONS = """
// eaglewire (kernel_args.cpp): sglang 0.5.23's argument lists over these kernels
void decode_attention_cpu_v0523(at::Tensor&, at::Tensor&, at::Tensor&, double, double, at::Tensor&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, at::Tensor&, at::Tensor&, at::Tensor&,
    at::Tensor&, at::Tensor&, double, double, bool, int64_t, std::optional<at::Tensor>, std::optional<at::Tensor>);
void extend_attention_cpu_v0523(at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    at::Tensor&, at::Tensor&, at::Tensor&, double, double, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&,
    at::Tensor&, int64_t, double, double, bool, int64_t, std::optional<at::Tensor>, std::optional<at::Tensor>,
    std::optional<at::Tensor>, bool);
at::Tensor fused_experts_cpu_v0523(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, bool, int64_t,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<std::vector<int64_t>>, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<double>&, const std::optional<double>&, bool,
    c10::string_view);

TORCH_LIBRARY_FRAGMENT(sgl_kernel, m) {"""

KERNEL_PATCHES = (
    Patch(name="decode-args-0.5.23", file="csrc/cpu/torch_extension_cpu.cpp",
          old=r'(?s)m\.def\(\s*"decode_attention_cpu\(.*?\) -> \(\)"\);\s*m\.impl\("decode_attention_cpu", '
              r'torch::kCPU, &decode_attention_cpu\);',
          new=f'm.def(\n      {_DECODE_SCHEMA});\n  m.impl("decode_attention_cpu", torch::kCPU, '
              f'&decode_attention_cpu_v0523);',
          done=r"&decode_attention_cpu_v0523\);",
          why="decode_attention_cpu takes 0.5.23's key_scale and value_scale (1.0: an unscaled cache)"),
    Patch(name="extend-args-0.5.23", file="csrc/cpu/torch_extension_cpu.cpp",
          old=r'(?s)m\.def\(\s*"extend_attention_cpu\(.*?\) -> \(\)"\);\s*m\.impl\("extend_attention_cpu", '
              r'torch::kCPU, &extend_attention_cpu\);',
          new=f'm.def(\n      {_EXTEND_SCHEMA});\n  m.impl("extend_attention_cpu", torch::kCPU, '
              f'&extend_attention_cpu_v0523);',
          done=r"&extend_attention_cpu_v0523\);",
          why="extend_attention_cpu takes 0.5.23's key_scale, value_scale and is_causal (causal only)"),
    Patch(name="experts-args-0.5.23", file="csrc/cpu/torch_extension_cpu.cpp",
          old=r'(?s)(m\.def\(\s*"fused_experts_cpu\(.*?bool is_vnni)\) -> Tensor"\);\s*m\.impl\("fused_experts_cpu", '
              r'torch::kCPU, &fused_experts_cpu\);',
          new=r'\g<1>, str activation=\"silu\") -> Tensor");\n  m.impl("fused_experts_cpu", torch::kCPU, '
              r'&fused_experts_cpu_v0523);',
          done=r"&fused_experts_cpu_v0523\);",
          why="fused_experts_cpu takes 0.5.23's activation (SiLU only): MoE layers run"),
    Patch(name="declare-adapters", file="csrc/cpu/torch_extension_cpu.cpp",
          old=r"\nTORCH_LIBRARY_FRAGMENT\(sgl_kernel, m\) \{", new=_DECLARATIONS,
          done=r"eaglewire \(kernel_args\.cpp\)",
          why="declares eaglewire's kernel_args.cpp, compiled beside the pinned sources"),
)

# SGLang's own CPU kernel tests of the same commit call the attention ops with that commit's argument lists
_TESTS = "cpu-tests-from-sglang/registered/cpu"
TEST_PATCHES = tuple(
    Patch(name=f"{test.removesuffix('.py')}-args-0.5.23", file=f"{_TESTS}/{test}",
          old=rf"({call}(?:\s+[a-z_]+,){{{before}}}\n(\s+)v_buffer,\n)",
          new=r"\g<1>\g<2>1.0,  # eaglewire: key_scale\n\g<2>1.0,  # eaglewire: value_scale\n",
          done=r"# eaglewire: key_scale", why=f"{test} calls {op} with 0.5.23's key_scale and value_scale (1.0)")
    for op, test, call, before in (
        ("decode_attention_cpu", "test_decode.py", r"torch\.ops\.sgl_kernel\.decode_attention_cpu\(", 2),
        ("extend_attention_cpu", "test_extend.py", r"torch\.ops\.sgl_kernel\.extend_attention_cpu\(", 5),
        ("extend_attention_cpu", "test_spec_kernels.py", r"args = \[", 5)))
KERNEL_TESTS = ("test_decode.py", "test_extend.py", "test_spec_kernels.py")


# the non-AMX gate in sglang 0.5.23 (srt/arg_groups/overrides.py, _attention_backend_platform_fallbacks): on a CPU
# without AMX it replaces intel_amx with torch_native, which its EAGLE path refuses; the kernels built here run
# intel_amx's ops on AVX-512 alone (they check for AMX at run time)
KEEP_AMX_ENV = "SGLANG_CPU_KERNELS_BUILT"
GATE_PATCH = Patch(
    name="keep-intel-amx-without-amx", file="sglang/srt/arg_groups/overrides.py",
    old=r'(view\.attention_backend == "intel_amx"\n\s+and view\.device == "cpu"\n(\s+)and not get_platform\(\)\.has_amx\n)',
    new=rf'\g<1>\g<2>and not __import__("os").environ.get("{KEEP_AMX_ENV}")  # eaglewire: the kernels were built\n',
    done=r"# eaglewire: the kernels were built",
    why=f"SGLang keeps the intel_amx backend on a CPU without AMX where {KEEP_AMX_ENV}=1 (eaglewire's launches set "
        "it; the kernels run its ops on AVX-512); unset, it falls back to torch_native as released")


# ------------------------------------------------------------------ compiling

def sources(root: Path) -> list[Path]:
    """What SGLang's CMake compiles on x86_64: every ``.cpp`` under ``csrc/cpu`` but the other architectures'
    directories, plus eaglewire's adapter."""
    cpu = root / "csrc" / "cpu"
    found = sorted(p for p in cpu.rglob("*.cpp") if p.relative_to(cpu).parts[0] not in ("aarch64", "ppc64"))
    return found + [ADAPTER]


def build_program(root: Path, build_dir: Path) -> str:
    """The python program the venv runs to compile and load ``common_ops`` (torch's extension builder, ninja)."""
    srcs = [str(p) for p in sources(root)]
    includes = [str(root / "csrc"), str(root / "include"), str(root / "csrc" / "cpu")]
    return ("import sys, torch.utils.cpp_extension as ext\n"
            f"m = ext.load(name='common_ops', sources={srcs!r}, extra_cflags={list(CFLAGS)!r}, "
            f"extra_ldflags={list(LDFLAGS)!r}, extra_include_paths={includes!r}, build_directory={str(build_dir)!r}, "
            "verbose=True)\n"
            "print('built', m.__file__)\n")


def built_library(build_dir: Path) -> Path:
    return build_dir / "common_ops.so"


def build(python: Path, root: Path, build_dir: Path, log: Path, *, jobs: int, timeout: float = 3600.0) -> Path:
    """``common_ops.so`` compiled by ``python`` (the SGLang venv's) from ``root``; the compiler's output to ``log``."""
    build_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MAX_JOBS=str(jobs))
    with open(log, "a") as out:
        out.write(f"$ {python} -c <build_program> (MAX_JOBS={jobs})\n")
        out.flush()
        try:
            proc = subprocess.run([str(python), "-c", build_program(root, build_dir)], stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KernelError(f"compiling SGLang's CPU kernels took over {timeout:.0f} s; log {log}") from None
    if proc.returncode != 0 or not built_library(build_dir).is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        hint = " (numa.h missing: apt-get install libnuma-dev)" if "numa.h" in tail else ""
        raise KernelError(f"compiling SGLang's CPU kernels failed{hint}; log {log}:\n{tail}")
    return built_library(build_dir)
