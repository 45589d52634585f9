"""DFlash launch flags, per engine: what each engine refuses, overrides with only a log line, or drafts
past the trained block, read from its released code (SGLang's ``_handle_dflash`` run from the wheel;
vLLM's and llama.cpp's texts pinned), and the doctor's "serving flags" check on a DFlash draft."""

from __future__ import annotations

import json
import sys
from types import ModuleType, SimpleNamespace

from pathlib import Path

import pytest

from eaglewire import engines
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.doctor_command import run_doctor
from eaglewire.doctor.engine_reading import lint_flags
from eaglewire.engines import sglang
from eaglewire.engines.llamacpp import find_tree
from tiny import save_random_dflash_draft, tiny_target
from test_dflash_engines import _compile, _function

L, BOUNDS, BLOCK = 8, [2, 4, 6], 4
VLLM_OK = '--speculative-config \'{"method": "dflash", "model": "d", "num_speculative_tokens": 3}\''
CLEAN = {
    "sglang": "--speculative-algorithm DFLASH --speculative-draft-model-path d",
    "vllm": VLLM_OK,
    "llamacpp": "-md d.gguf --spec-type draft-dflash --spec-draft-n-max 3",
    "eaglewire": "--speculative-num-steps 3",
}


def _lint(engine: str, flags: str):
    return lint_flags(engine, flags, BOUNDS, L, "llama", dflash_block=BLOCK)


@pytest.mark.parametrize("engine", sorted(CLEAN))
def test_the_flags_a_block_of_four_is_served_with_pass_drafting_three(engine):
    got = _lint(engine, CLEAN[engine])
    assert got.problems == [] and got.num_steps == BLOCK - 1


# (engine, flags, verdict, words the problem must name)
PROBLEMS = [
    ("sglang", "--speculative-algorithm EAGLE3 --speculative-draft-model-path d", "fail", "EAGLE3: SGLang will not"),
    ("sglang", "--speculative-algorithm DFLASH", "fail", "--speculative-draft-model-path"),
    ("sglang", CLEAN["sglang"] + " --speculative-num-steps 5", "warn", "overrides it to 1"),
    ("sglang", CLEAN["sglang"] + " --speculative-eagle-topk 4", "warn", "overrides it to 1"),
    ("sglang", CLEAN["sglang"] + " --speculative-num-draft-tokens 4 --speculative-dflash-block-size 8", "fail",
     "refuses to start"),
    ("sglang", CLEAN["sglang"] + " --speculative-num-draft-tokens 16", "warn", "block size mismatch"),
    ("sglang", CLEAN["sglang"] + " --speculative_num_draft_tokens 4", "fail", "only dashes"),
    ("vllm", '--speculative-config \'{"method": "eagle3", "model": "d", "num_speculative_tokens": 3}\'', "fail",
     "'eagle3'"),
    ("vllm", '--speculative-config \'{"model": "my-draft", "num_speculative_tokens": 3}\'', "fail", "'draft_model'"),
    ("vllm", '--speculative-config \'{"method": "dflash", "model": "d"}\'', "fail", "num_speculative_tokens"),
    ("vllm", '--speculative-config \'{"method": "dflash", "model": "d", "num_speculative_tokens": 7}\'', "warn",
     "untrained"),
    ("vllm", "--max-model-len 4096", "fail", "no --speculative-config"),
    ("llamacpp", "-md d.gguf --spec-type draft-eagle3", "fail", "DFlash"),
    ("llamacpp", "-md d.gguf --spec-type draft-dflash --spec-draft-n-max 8", "warn", "clamps"),
    ("llamacpp", "--spec-type draft-dflash", "fail", "no draft model"),
    ("llamacpp", "-md d.gguf --spec-type draft-eagle3 --spec-draft-n-max 3 --spec-type draft-dflash", "fail",
     "also run as draft-eagle3"),
    ("eaglewire", "--speculative-num-steps 5", "fail", "at most 3"),
]


@pytest.mark.parametrize("engine, flags, verdict, words", PROBLEMS)
def test_each_problem_is_named_with_its_verdict_and_a_fix(engine, flags, verdict, words):
    problems = _lint(engine, flags).problems
    assert [v for v, _, _ in problems] == [verdict], problems
    _, what, fix = problems[0]
    assert words in what and fix, problems


def test_what_each_engine_drafts_per_round():
    """The tokens drafted per round, which the doctor's predicted τ uses: SGLang's verify window less its
    anchor (the draft's block_size when no flag says), vLLM's num_speculative_tokens as given, llama.cpp's
    n_max clamped to the block."""
    assert _lint("sglang", CLEAN["sglang"]).num_draft_tokens == BLOCK
    assert _lint("sglang", CLEAN["sglang"] + " --speculative-dflash-block-size 8").num_steps == 7
    assert _lint("vllm", VLLM_OK.replace(": 3", ": 7")).num_steps == 7
    assert _lint("llamacpp", "-md d.gguf --spec-type draft-dflash --spec-draft-n-max 8").num_steps == BLOCK - 1
    assert _lint("llamacpp", "-md d.gguf --spec-type draft-dflash").num_steps is None  # llama.cpp's default 3


def test_an_engine_without_a_dflash_reading_is_refused_by_name():
    with pytest.raises(ValueError, match="specforge"):
        lint_flags("specforge", "", BOUNDS, L, "llama", dflash_block=BLOCK)


# ---------------------------------------------------------------- the engines' own code

class _Log:
    def __init__(self):
        self.lines: list[str] = []

    def warning(self, message, *args):
        self.lines.append(message % args)


def _sglang_handle_dflash(wheel, monkeypatch, draft_config: dict):
    """sglang's ``_handle_dflash`` from the wheel, on CUDA and one pipeline stage; the draft config it reads
    when no flag gives the window is ``draft_config`` (read as ``parse_dflash_draft_config`` reads block_size)."""
    log = _Log()

    def declare_resolution(server_args, who, **values):
        for k, v in values.items():
            setattr(server_args, k, v)

    def parse(*, draft_hf_config):
        inner = getattr(draft_hf_config, "dflash_config", None) or {}
        block = inner.get("block_size", getattr(draft_hf_config, "block_size", None))
        return SimpleNamespace(resolve_block_size=lambda default=None: block if block is not None else default)

    utils = ModuleType("sglang.srt.speculative.dflash_utils")
    utils.parse_dflash_draft_config = parse
    hf = ModuleType("sglang.srt.utils.hf_transformers_utils")
    hf.get_config = lambda path, **k: SimpleNamespace(**draft_config)
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    monkeypatch.setitem(sys.modules, hf.__name__, hf)
    handle = _compile(_function(wheel, "sglang/srt/arg_groups/speculative_hook.py", "_handle_dflash"),
                      resolving_view=lambda s: s, declare_resolution=declare_resolution, logger=log, json=json,
                      current_platform=SimpleNamespace(is_out_of_tree=lambda: False),
                      attn_dp_enabled_of=lambda cfg: False, _resolve_dflash_draft_attention_backend=lambda s: None)
    return handle, log


def _server_args(flags: str) -> SimpleNamespace:
    args, problems = sglang.read_flags(flags)
    assert problems == []
    fields = {k: None for k in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
                                "speculative_num_draft_tokens", "speculative_dflash_block_size",
                                "speculative_draft_window_size", "speculative_draft_model_revision",
                                "max_running_requests")}
    fields.update({k[2:].replace("-", "_"): (int(v) if v.isdigit() else v) for k, v in args.items()})
    return SimpleNamespace(**fields, device="cuda", pp_size=1, json_model_override_args="{}", trust_remote_code=False)


@pytest.mark.engines
@pytest.mark.parametrize("extra", ["", " --speculative-num-steps 5", " --speculative-eagle-topk 4",
                                   " --speculative-num-draft-tokens 4 --speculative-dflash-block-size 8",
                                   " --speculative-num-draft-tokens 16", " --speculative-dflash-block-size 4"])
def test_sglang_s_own_handler_does_what_the_lint_says(tmp_path, wheels, monkeypatch, extra):
    """Run SGLang 0.5.23's _handle_dflash on each launch: it raises where the lint fails, logs an override where
    the lint warns of one, and resolves the verify window the lint reports; the draft config it reads is
    eaglewire's own SGLang export of a block-4 draft."""
    target = tiny_target("llama", num_layers=L, hidden_size=64, vocab_size=256)
    native = save_random_dflash_draft(tmp_path / "native", target, BOUNDS, block_size=BLOCK)
    engines.export_draft(native, "sglang", tmp_path / "sgl", target_arch="llama")
    handle, log = _sglang_handle_dflash(wheels["sglang"], monkeypatch,
                                        json.loads((tmp_path / "sgl" / "config.json").read_text()))
    flags = CLEAN["sglang"] + extra
    lint = _lint("sglang", flags)
    server_args = _server_args(flags)
    if any(v == "fail" for v, _, _ in lint.problems):
        with pytest.raises(ValueError, match="must match"):
            handle(server_args)
        return
    handle(server_args)
    assert server_args.speculative_num_steps == 1 and server_args.speculative_eagle_topk == 1
    assert server_args.speculative_num_draft_tokens == lint.num_draft_tokens == lint.num_steps + 1
    overridden = [line for line in log.lines if "overriding" in line]
    assert len(overridden) == sum("overrides it to 1" in what for _, what, _ in lint.problems)
    mismatch = server_args.speculative_num_draft_tokens != BLOCK
    assert mismatch == any("block size mismatch" in what for _, what, _ in lint.problems)


@pytest.mark.engines
def test_sglang_logs_the_block_size_mismatch_it_lets_through(wheels):
    text = wheels["sglang"].text("sglang/srt/speculative/dflash_worker_v2.py")
    assert "DFLASH block size mismatch" in text and "logger.warning" in text


@pytest.mark.engines
def test_vllm_detects_dflash_after_eagle_and_demands_the_token_count(wheels):
    """vllm/config/speculative.py 0.33.0: the path detection order detect_method follows, the error a missing
    num_speculative_tokens raises; v1/spec_decode/dflash.py drafts 1 + num_speculative_tokens positions."""
    text = wheels["vllm"].text("vllm/config/speculative.py")
    order = [text.index(s) for s in ('"eagle-" in self.draft_model_config', '"eagle3" in self.draft_model_config',
                                     '"dflash" in self.draft_model_config')]
    assert order == sorted(order)
    assert "`num_speculative_tokens` was not provided" in text
    assert "1 + self.num_speculative_tokens" in wheels["vllm"].text("vllm/v1/spec_decode/dflash.py")
    assert engines.vllm.detect_method("runs/my-dflash") == "dflash"
    assert engines.vllm.detect_method("runs/eagle3-dflash") == "eagle3"


@pytest.mark.engines
def test_llamacpp_clamps_to_the_block_and_appends_spec_types_as_the_lint_says():
    tree = find_tree()
    if tree is None:
        pytest.skip("no llama.cpp source tree (`eaglewire engines install llamacpp` unpacks it)")
    text = (tree / "common" / "speculative.cpp").read_text()
    assert "exceeds the trained block size" in text and "block_size - 1" in text
    args = (tree / "common" / "arg.cpp").read_text()
    assert "params.speculative.types.insert(params.speculative.types.end(), types.begin(), types.end());" in args


def test_tune_probes_a_dflash_gguf_with_one_spec_type():
    """tune's llama-server launches name --spec-type once: a second would add a type, not replace it."""
    from eaglewire.engines.interface import RunSettings, ServedFiles, Shape
    from eaglewire.engines.llamacpp import server_args
    from eaglewire.engines.llamacpp.lint import spec_types
    from eaglewire.engines.llamacpp.runtime import launch_config

    for block, want in ((True, ["draft-dflash"]), (False, ["draft-eagle3"])):
        files = ServedFiles(Path("t.gguf"), Path("d.gguf"), "dflash" if block else "eagle3")
        launch = server_args(launch_config(files, Shape(3), RunSettings(), draft_timing=True), port=1)
        assert spec_types(" ".join(launch)) == want
    assert spec_types("-md d --spec-type draft-eagle3,ngram-mod --spec-type=draft-dflash") == [
        "draft-eagle3", "ngram-mod", "draft-dflash"]


# ---------------------------------------------------------------- the doctor

@pytest.mark.parametrize("engine, flags, verdict", [("sglang", CLEAN["sglang"], "ok"),
                                                    ("sglang", CLEAN["sglang"] + " --speculative-num-steps 5", "warn"),
                                                    ("vllm", '--speculative-config \'{"method": "dflash", "model": "d"}\'',
                                                     "fail"),
                                                    ("llamacpp", CLEAN["llamacpp"] + "0", "warn")])
def test_the_doctor_lints_a_dflash_draft_s_launch_flags(tmp_path, monkeypatch, engine, flags, verdict):
    import eaglewire.doctor.doctor_command as doctor_run

    monkeypatch.setattr(doctor_run, "_load_sequences", lambda *a, **k: ([], "none"))
    target = tiny_target("llama", num_layers=L, hidden_size=64, vocab_size=256)
    native = save_random_dflash_draft(tmp_path / "native", target, BOUNDS, block_size=BLOCK)
    report = run_doctor(DoctorConfig(draft=str(native), engine=engine, engine_flags=flags, target_arch="llama",
                                     tune=False), target=target)
    check = next(c for c in report.checks if c.name == "serving flags")
    assert check.verdict == verdict, check


# ---------------------------------------------------------------- what eaglewire tells users to launch

def _launch(serving_md: str) -> str:
    """The flags of SERVING.md's launch command (its ```bash block, continuations joined, its first two words dropped: `python -m`, `vllm serve`, `llama-server -m`)."""
    block = serving_md.split("```bash\n", 1)[1].split("```", 1)[0]
    return " ".join(line.rstrip(" \\") for line in block.splitlines()).split(None, 2)[2]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_launch_each_export_writes_passes_that_engine_s_lint(tmp_path, engine):
    target = tiny_target("llama", num_layers=L, hidden_size=64, vocab_size=256)
    native = save_random_dflash_draft(tmp_path / "native", target, BOUNDS, block_size=BLOCK)
    engines.export_draft(native, engine, tmp_path / engine, target_arch="llama")
    flags = _launch((tmp_path / engine / "SERVING.md").read_text())
    got = _lint(engine, flags)
    assert got.problems == [] and got.num_steps == BLOCK - 1, (flags, got)


def test_the_launch_the_llamacpp_export_writes_passes_its_lint():
    from eaglewire.engines.llamacpp.dflash_export import dflash_serving_md

    flags = _launch(dflash_serving_md(target_gguf="t.gguf", draft_gguf="d.gguf", boundaries=BOUNDS,
                                      block_size=BLOCK, threads=2))
    got = _lint("llamacpp", flags)
    assert got.problems == [] and got.num_steps == BLOCK - 1, (flags, got)
