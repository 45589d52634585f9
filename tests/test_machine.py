from eaglewire.core.machine import _cpuinfo, describe, native_bf16, summary_line

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16
"""


def test_cpuinfo_reads_the_model_and_flags_of_the_first_processor(tmp_path):
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    model, flags = _cpuinfo(tmp_path / "cpuinfo")
    assert model == "AMD EPYC 9R14" and {"avx2", "avx512_bf16"} <= flags and "amx_bf16" not in flags


def test_bf16_is_native_only_where_the_cpu_has_bf16_instructions():
    # oneDNN's probe says yes on plain AVX-512 too (it converts); the CPU's flags decide.
    assert not native_bf16({"avx2", "fma", "avx512f", "avx512bw"})


def test_summary_names_cpu_simd_and_torch_capability():
    info = describe()
    line = summary_line(info)
    assert str(info["cpu"]) in line and str(info["torch_cpu_capability"]) in line and "threads" in line
