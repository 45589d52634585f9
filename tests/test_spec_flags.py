"""The speculation settings are defined once, in SpecConfig: every command's flags (generate, serve)
and bench's config strings come from its fields, so a hand-written copy (another name, default or
help) fails here."""

import argparse
import dataclasses

import pytest

from eaglewire.bench.bench_command import config_label, parse_configs
from eaglewire.cli import build_parser
from eaglewire.core.configs import config_from_args, config_to_args
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.serve.serve_config import ServeConfig, add_serve_args


def generate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser


def expected_flags() -> dict[str, tuple[str, object]]:
    """``--flag`` -> (help, type) of each SpecConfig field, from its metadata."""
    return {"--" + f.metadata["flag"]: (f"{f.metadata['help']} (default: {f.default})", f.type)
            for f in dataclasses.fields(SpecConfig)}


@pytest.mark.parametrize("parser", [generate_parser, serve_parser])
def test_speculation_flags_are_spec_config_fields(parser):
    expected = expected_flags()
    assert set(expected) == {"--speculative-num-steps", "--speculative-eagle-topk",
                             "--speculative-num-draft-tokens", "--draft-min-prob"}  # SGLang's names + ours
    actions = {s: a for a in parser()._actions for s in a.option_strings}
    for flag, (help_text, tp) in expected.items():
        action = actions[flag]
        assert action.help == help_text and action.default is argparse.SUPPRESS, flag
        assert action.type.__name__ == tp, flag
    # no second spelling of a speculation setting (e.g. --num-steps, --topk) beside them
    reporting = {"--per-request-spec-decode-metrics"}  # serve: what the answers report, not how it drafts
    extra = {s for s in actions if any(w in s for w in ("topk", "draft-tokens", "min-prob", "spec"))} - reporting
    assert extra == set(expected)


@pytest.mark.parametrize("parser, cls", [(generate_parser, SpecConfig), (serve_parser, ServeConfig)])
def test_speculation_flags_build_the_spec_config(parser, cls):
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, min_prob=0.25)
    argv = config_to_args(spec) + (["--target", "x"] if cls is ServeConfig else ["--prompt", "p"])
    got = config_from_args(cls, parser().parse_args(argv))
    assert (got if cls is SpecConfig else got.spec) == spec
    assert [f.name for f in dataclasses.fields(ServeConfig) if f.name in {g.name for g in dataclasses.fields(SpecConfig)}
            or "speculative" in f.name or "min_prob" in f.name] == []


def test_bench_configs_parse_into_spec_configs():
    specs = [None, SpecConfig.chain(5), SpecConfig(num_steps=6, topk=4, num_draft_tokens=24),
             SpecConfig.chain(5, min_prob=0.1)]
    text = ";".join(config_label(s) for s in specs)
    assert text == "1,0,0,0;1,5,1,6;1,6,4,24;1,5,1,6,0.1"
    assert parse_configs(text) == specs


# ---------------------------------------------------------------- engines' launch flags, as their parsers read them

VLLM_SPELLINGS = [
    """--speculative-config '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}'""",
    """-sc '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}'""",
    """--speculative_config '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}'""",
    """--speculative-config='{"method":"eagle3","model":"/d","num_speculative_tokens":4}'""",
    "--speculative-config.method eagle3 --speculative-config.model /d --speculative-config.num_speculative_tokens 4",
    "--speculative_config.method=eagle3 --speculative-config.model=/d --speculative_config.num_speculative_tokens 4",
    """--speculative-config '{"model": "/runs/llama-eagle3-draft", "num_speculative_tokens": 4}'""",  # detected
]


@pytest.mark.parametrize("flags", VLLM_SPELLINGS)
def test_every_vllm_spelling_of_the_speculative_config_is_read(flags):
    from eaglewire.doctor.engine_reading import lint_flags

    got = lint_flags("vllm", "serve org/target " + flags, [2, 15, 27], 30, "llama")
    assert got.problems == [] and got.num_steps == 4, got.problems


def test_vllm_dotted_keys_merge_into_one_object_read_as_json():
    from eaglewire.engines.serving.launch_flags import parse_flexible

    args, notes = parse_flexible("--speculative-config.num_speculative_tokens 3 --speculative-config.draft.x+ a,b "
                                 "--max_model_len 99", {"-sc": "--speculative-config"})
    assert args == {"--speculative-config": {"num_speculative_tokens": 3, "draft": {"x": ["a", "b"]}},
                    "--max-model-len": "99"} and notes == []


def test_vllm_dotted_keys_under_two_spellings_stay_apart_and_the_last_wins():
    """FlexibleArgumentParser merges dotted keys per spelling: ``-sc.x`` after ``--speculative-config.method``
    replaces the whole object, so the method is lost (vLLM then detects it from the path)."""
    from eaglewire.doctor.engine_reading import lint_flags

    got = lint_flags("vllm", "--speculative-config.method eagle3 -sc.num_speculative_tokens 4", [2, 15, 27], 30)
    assert [v for v, _, _ in got.problems] == ["warn", "fail"] and "only" in got.problems[0][1]
    assert "'draft_model'" in got.problems[1][1]


@pytest.mark.parametrize("model, method", [("/runs/my-draft", "draft_model"), ("yuhuili/EAGLE-LLaMA3-8B", "eagle"),
                                           ("AngelSlim/Qwen3-8B_eagle3", "eagle3")])
def test_an_omitted_vllm_method_is_what_vllm_detects_from_the_path(model, method):
    from eaglewire.doctor.engine_reading import lint_flags
    from eaglewire.engines.vllm import detect_method

    assert detect_method(model) == method
    got = lint_flags("vllm", f"""-sc '{{"model": "{model}", "num_speculative_tokens": 3}}'""", [2, 15, 27], 30)
    assert (got.problems == []) == (method == "eagle3")
    if method != "eagle3":
        assert got.problems[0][0] == "fail" and repr(method) in got.problems[0][1] and '"eagle3"' in got.problems[0][2]


def test_no_vllm_speculative_config_in_any_spelling_is_a_fail():
    from eaglewire.doctor.engine_reading import lint_flags

    [(verdict, what, _)] = lint_flags("vllm", "serve org/target --max-model-len 4096", [2, 15, 27], 30).problems
    assert verdict == "fail" and "without speculation" in what


@pytest.mark.parametrize("flags", [
    "--speculative-algorithm EAGLE3 --speculative-draft-model-path /d --speculative-num-steps 3",
    "--speculative-algorithm=EAGLE3 --speculative-draft-model /d --speculative-num-steps=3",  # its alias
    "--speculative-algo EAGLE3 --speculative-draft-model /d --speculative-num-s 3",  # argparse abbreviations
])
def test_sglang_aliases_and_abbreviations_read_as_its_parser_reads_them(flags):
    from eaglewire.engines.sglang import read_flags

    args, problems = read_flags(flags)
    assert problems == [] and args["--speculative-algorithm"] == "EAGLE3" and args["--speculative-num-steps"] == "3"
    assert args["--speculative-draft-model-path"] == "/d"


def test_sglang_refuses_ambiguous_abbreviations_and_underscores():
    from eaglewire.doctor.engine_reading import lint_flags

    got = lint_flags("sglang", "--speculative-algorithm EAGLE --speculative-num 3 --speculative_eagle_topk 1",
                     [2, 15, 27], 30)
    whats = [w for _, w, _ in got.problems]
    assert any("abbreviates several" in w for w in whats) and any("only dashes" in w for w in whats)
    assert any("--speculative-algorithm EAGLE:" in w for w in whats)
