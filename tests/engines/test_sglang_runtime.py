"""SGLang as eaglewire runs it, without SGLang: the kernels' patches on the pinned source (applied once, idempotent,
refused on another release), the CPU check, the launch's pure halves, a request's account from its meta_info, the
flags a running server reports, and ``engines install|which sglang``'s options."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from eaglewire.engines.interface import ServedFiles, Shape
from eaglewire.engines.sglang import kernels
from eaglewire.engines.interface import RunSettings
from eaglewire.engines.sglang.installation import SglangError
from eaglewire.engines.sglang.server import (RUNTIME, flags_from_info, generate_body, head_size_refusal, launch_args,
                                             launch_env, refusal, request_stats)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel_source(tmp_path_factory):
    """The pinned archive unpacked (skips where the shared third_party directory is not beside the checkout)."""
    if not any(p.is_file() for p in kernels.archive_candidates(REPO)):
        pytest.skip(f"{kernels.KERNEL_ARCHIVE} is not in ../shared/third_party here")
    work = tmp_path_factory.mktemp("sglk")
    return kernels.resolve_source(None, REPO, work, work / "log")


def test_patches_apply_once_to_the_pinned_source(kernel_source):
    root = kernel_source.root
    before = (root / "csrc/cpu/torch_extension_cpu.cpp").read_text()
    said = [kernels.apply(root, p) for p in (*kernels.KERNEL_PATCHES, *kernels.TEST_PATCHES)]
    assert not any("already" in s for s in said)
    text = (root / "csrc/cpu/torch_extension_cpu.cpp").read_text()
    assert text != before
    # the two schemas now take 0.5.23's arguments and dispatch to the adapter
    assert "float key_scale, float value_scale, Tensor(a!) output" in text
    assert "Tensor? tree_mask=None, bool is_causal=True) -> ()" in text
    assert 'bool is_vnni, str activation=\\"silu\\") -> Tensor");' in text  # the MoE experts' activation
    for op in ("decode_attention_cpu", "extend_attention_cpu", "fused_experts_cpu"):
        assert f"&{op}_v0523);" in text and f"&{op});" not in text, op
    # every test call site of the attention ops passes the two scales
    tests = root / "cpu-tests-from-sglang/registered/cpu"
    for name in ("test_decode.py", "test_extend.py", "test_spec_kernels.py"):
        assert (tests / name).read_text().count("1.0,  # eaglewire: key_scale") == 1, name
    # twice: nothing changes
    again = [kernels.apply(root, p) for p in (*kernels.KERNEL_PATCHES, *kernels.TEST_PATCHES)]
    assert all("already applied" in s for s in again)
    assert (root / "csrc/cpu/torch_extension_cpu.cpp").read_text() == text
    # the adapter and every source SGLang's CMake compiles on x86_64, none of another architecture's
    srcs = kernels.sources(root)
    assert kernels.ADAPTER in srcs and kernels.ADAPTER.is_file()
    assert not any("aarch64" in str(p) for p in srcs)
    assert len(srcs) == 29


def test_a_patch_that_no_longer_matches_is_refused(tmp_path):
    (tmp_path / "csrc/cpu").mkdir(parents=True)
    (tmp_path / "csrc/cpu/torch_extension_cpu.cpp").write_text('m.def("decode_attention_cpu(Tensor q) -> Tensor");\n')
    with pytest.raises(kernels.KernelError, match="decode-args-0.5.23.*found 0"):
        kernels.apply(tmp_path, kernels.KERNEL_PATCHES[0])


def test_the_gate_patch_keeps_intel_amx_only_where_asked(tmp_path):
    released = ('def _attention_backend_platform_fallbacks(view: Any) -> dict:\n    if (\n'
                '        view.attention_backend == "intel_amx"\n        and view.device == "cpu"\n'
                '        and not get_platform().has_amx\n    ):\n        return {"attention_backend": "torch_native"}\n')
    path = tmp_path / kernels.GATE_PATCH.file
    path.parent.mkdir(parents=True)
    path.write_text(released)
    kernels.apply(tmp_path, kernels.GATE_PATCH)
    patched = path.read_text()
    assert patched.count(kernels.KEEP_AMX_ENV) == 1

    class Platform:
        has_amx = False

    class View:
        attention_backend, device = "intel_amx", "cpu"

    scope: dict = {"Any": object, "get_platform": lambda: Platform}
    exec(patched, scope)  # noqa: S102 - the patched function itself, run on a CPU without AMX
    fallback = scope["_attention_backend_platform_fallbacks"]
    import os

    saved = os.environ.pop(kernels.KEEP_AMX_ENV, None)
    try:
        assert fallback(View) == {"attention_backend": "torch_native"}  # as released
        os.environ[kernels.KEEP_AMX_ENV] = "1"
        assert fallback(View) is None  # kept: no override returned
    finally:
        os.environ.pop(kernels.KEEP_AMX_ENV, None)
        if saved is not None:
            os.environ[kernels.KEEP_AMX_ENV] = saved


def test_a_changed_archive_is_refused(tmp_path):
    fake = tmp_path / kernels.KERNEL_ARCHIVE
    fake.write_bytes(b"not the kernels")
    with pytest.raises(kernels.KernelError, match="not the pinned kernel source"):
        kernels.resolve_source(str(fake), REPO, tmp_path / "work", tmp_path / "log")


def test_no_source_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLEWIRE_THIRD_PARTY", raising=False)
    with pytest.raises(kernels.KernelError, match="--kernel-source"):
        kernels.resolve_source(None, tmp_path / "a" / "b", tmp_path / "work", tmp_path / "log")
    with pytest.raises(kernels.KernelError, match="csrc/cpu"):
        kernels.resolve_source(str(tmp_path), REPO, tmp_path / "work", tmp_path / "log")


def test_cpu_flags():
    avx512_bf16 = "flags\t: fpu sse avx2 avx512f avx512bw avx512vl avx512dq avx512cd avx512_bf16 avx512_vnni amx_tile\n"
    assert kernels.missing_cpu_flags(avx512_bf16) == []
    avx2 = "flags\t: fpu sse avx avx2 fma\n"
    assert kernels.missing_cpu_flags(avx2) == list(kernels.NEEDED_FLAGS)
    no_bf16 = avx512_bf16.replace(" avx512_bf16", "")
    assert kernels.missing_cpu_flags(no_bf16) == ["avx512_bf16"]


# ------------------------------------------------------------------ the launch

def test_launch_args_for_a_chain_and_plain():
    files = ServedFiles(target=Path("/t"), draft=Path("/d"))
    args = launch_args(files, Shape(n_max=3), port=1234, flags=["--log-level", "warning"])
    joined = " ".join(args)
    assert "--device cpu --attention-backend intel_amx" in joined
    assert ("--speculative-algorithm EAGLE3 --speculative-draft-model-path /d --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4") in joined
    assert args[-2:] == ["--log-level", "warning"]  # the user's flags last: they override
    plain = launch_args(ServedFiles(target=Path("/t"), draft=None), Shape(), port=1234)
    assert not any(a.startswith("--speculative") for a in plain)
    with pytest.raises(ValueError, match="needs a draft"):
        launch_args(ServedFiles(target=Path("/t"), draft=None), Shape(n_max=2), port=1)


def test_shapes_it_refuses():
    assert refusal(Shape(n_max=3), "eagle3") is None
    assert "p-min" in refusal(Shape(n_max=3, p_min=0.2), "eagle3")
    assert "CUDA path" in refusal(Shape(n_max=3), "dflash")
    assert refusal(Shape(), "dflash") is None  # plain serves any target


def test_head_sizes_its_cpu_attention_refuses():
    """The extend kernel stops a server at its first prompt on a head size that is not a multiple of 32 (CI's
    tiny targets have 16): refused before the launch, saying what would run."""
    assert head_size_refusal({"hidden_size": 576, "num_attention_heads": 9}, "t") is None  # SmolLM2-135M: 64
    assert head_size_refusal({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 128}, "t") is None
    assert head_size_refusal({"text_config": {"hidden_size": 128, "num_attention_heads": 2}}, "t") is None
    why = head_size_refusal({"hidden_size": 64, "num_attention_heads": 4}, "the target t")
    assert why and "the target t has attention heads of size 16" in why and "--costs stated" in why
    assert head_size_refusal({"hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 32}, "t") is None  # MLA


def test_a_tiny_target_is_refused_before_any_launch(target_dir, tmp_path):
    with pytest.raises(SglangError, match="attention heads of size 16"):
        RUNTIME.files(None, str(target_dir), tmp_path, RunSettings())


def test_its_shared_memory_segments_are_named_by_the_launch(tmp_path):
    """The CPU kernels' all-reduce buffer (258 MiB a launch, never unlinked by SGLang) takes its name from
    MASTER_ADDR/MASTER_PORT: the launch sets them, so the server's own segments (and no other's) are found."""
    from eaglewire.engines.sglang.server import shm_segments

    env = launch_env(2, cpus=[0, 1], base={}, shm_port=41234)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "41234"
    for name in ("deepspeed_allreduce_buffer_0_127.0.0.1_41234_0", "deepspeed_allreduce_buffer_0_127.0.0.1_41234_1",
                 "deepspeed_allreduce_buffer_0_127.0.0.1_51234_0", "deepspeed_allreduce_buffer_7_127.0.0.1_41234_0"):
        (tmp_path / name).write_text("")
    assert [p.name for p in shm_segments(41234, 0, tmp_path)] == ["deepspeed_allreduce_buffer_0_127.0.0.1_41234_0",
                                                                  "deepspeed_allreduce_buffer_0_127.0.0.1_41234_1"]
    assert "MASTER_PORT" not in launch_env(2, cpus=[0, 1], base={})


def test_launch_env_binds_threads_and_keeps_intel_amx():
    env = launch_env(2, cpus=[4, 5, 6], base={"OMP_NUM_THREADS": "8", "PATH": "/bin"})
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "4-5"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env[kernels.KEEP_AMX_ENV] == "1"
    assert "OMP_NUM_THREADS" not in env and env["PATH"] == "/bin"
    with pytest.raises(Exception, match="3 threads asked"):
        launch_env(3, cpus=[0, 1])


def test_generate_body():
    greedy = generate_body([1, 2], max_new_tokens=5, temperature=0.0, seed=3)
    assert greedy["input_ids"] == [1, 2] and greedy["sampling_params"]["temperature"] == 0.0
    assert "sampling_seed" not in greedy["sampling_params"]
    sampled = generate_body([1], max_new_tokens=5, temperature=0.7, seed=3, ignore_eos=True)["sampling_params"]
    assert sampled["sampling_seed"] == 3 and sampled["top_k"] == -1 and sampled["ignore_eos"]


def test_request_stats_from_meta_info():
    """A real answer's meta_info (SGLang 0.5.23, a chain of 3, 32 tokens): 17 verify steps, histogram
    [10, 3, 0, 4] -> 15 accepted drafted tokens; the prefill gave the first token."""
    meta = {"finish_reason": {"type": "length", "length": 32}, "completion_tokens": 32, "spec_verify_ct": 17,
            "spec_num_correct_drafts": 15, "spec_num_proposed_drafts": 51, "spec_correct_drafts_histogram": [10, 3, 0, 4],
            "first_token_latency": 0.13, "e2e_latency": 1.43}
    stats = request_stats(prompt_tokens=10, tokens=list(range(32)), meta_info=meta, wall_seconds=9.0)
    assert sorted(stats.accept_lengths) == [1] * 10 + [2] * 3 + [4] * 4
    assert sum(stats.accept_lengths) == 32  # SGLang's own account: verify steps + accepted = completion tokens
    assert stats.verified_lengths == [4] * 17
    assert stats.position_accepts == [7, 4, 4]
    assert stats.prefill_seconds == pytest.approx(0.13) and stats.total_seconds == pytest.approx(1.43)
    assert stats.finish_reason == "length"
    plain = request_stats(prompt_tokens=3, tokens=[5, 6, 7], meta_info={"finish_reason": {"type": "stop"}},
                          wall_seconds=2.0)
    assert plain.accept_lengths == [1, 1] and plain.total_seconds == 2.0 and plain.finish_reason == "stop"


def test_flags_from_server_info():
    info = {"model_path": "/m", "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/d x",
            "speculative_num_steps": 1, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 16,
            "speculative_token_map": None, "speculative_adaptive": False, "version": "0.5.23", "port": 30000}
    flags = flags_from_info(info)
    parts = shlex.split(flags)
    assert parts[:2] == ["--model-path", "/m"]
    assert parts[parts.index("--speculative-draft-model-path") + 1] == "/d x"
    assert parts[parts.index("--speculative-num-draft-tokens") + 1] == "16"
    assert "--speculative-adaptive" not in parts and "--speculative-token-map" not in parts
    assert "--port" not in parts  # launch settings that are not the draft's are left out


# ------------------------------------------------------------------ the command's options

def test_engines_options_belong_to_their_engine():
    from eaglewire.engines.command_settings import EnginesConfig

    settings = EnginesConfig(action="install", engine="sglang", kernel_source="/src", jobs=2).settings()
    assert settings.source == "/src" and settings.jobs == 2 and settings.export is not None
    assert EnginesConfig(action="which", engine="sglang", sglang_python="/py").settings().install == "/py"
    with pytest.raises(ValueError, match="are for `engines ... sglang`"):
        EnginesConfig(action="install", engine="vllm", kernel_source="/src")
    with pytest.raises(ValueError, match="--llamacpp-dir and --build"):
        EnginesConfig(action="install", engine="sglang", build=True)
