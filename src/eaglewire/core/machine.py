"""What this machine computes with: CPU model, the SIMD extensions that change kernels, torch's
CPU capability and thread count. CI prints it before the tests (a red run names its machine) and
every figure in BENCHMARKS.md names it.

Machines of one kind differ in CPU model: some are AVX2-only, others have AVX-512 with bf16 and
VNNI, and oneDNN / MKL pick different kernels (and summation orders) on each.

    python -m eaglewire.core.machine        # one line for logs
"""

from __future__ import annotations

import platform
from pathlib import Path

# The flags that select different matmul / attention kernels in oneDNN, MKL and ggml.
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile", "avx_vnni")


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor listed, or (platform's name, empty)."""
    model, flags = None, set()
    try:
        lines = path.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.processor() or platform.machine(), flags


def cpu() -> tuple[str, set[str]]:
    """(model name, flags) of this machine's CPU, from ``/proc/cpuinfo``."""
    return _cpuinfo()


def describe() -> dict[str, object]:
    """The machine as a JSON-able mapping."""
    import torch

    model, flags = _cpuinfo()
    return {
        "cpu": model,
        "simd": [f for f in SIMD_FLAGS if f in flags],
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16(flags),
        "threads": torch.get_num_threads(),
    }


def native_bf16(flags: set[str] | None = None) -> bool:
    """True when oneDNN computes bf16 matmuls natively here (AVX-512 bf16 or AMX), so bf16 is a
    speed-up rather than an emulation. oneDNN's own probe also says yes for plain AVX-512 (which
    converts), so the CPU's flags decide."""
    import torch

    if flags is None:
        flags = _cpuinfo()[1]
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return False
    mkldnn = getattr(torch.backends, "mkldnn", None)
    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    if mkldnn is None or not mkldnn.is_available() or probe is None:
        return False
    return bool(probe())


def summary_line(info: dict[str, object] | None = None) -> str:
    info = info or describe()
    simd = " ".join(info["simd"]) or "none of " + ",".join(SIMD_FLAGS[:2])
    return (f"cpu: {info['cpu']} | simd: {simd} | torch {info['torch']} capability "
            f"{info['torch_cpu_capability']} | native bf16: {'yes' if info['native_bf16'] else 'no'} | "
            f"threads {info['threads']}")


if __name__ == "__main__":
    print(summary_line())
