"""The speculation settings are defined once, in SpecConfig: every command's flags (generate, serve)
and bench's config strings come from its fields, so a hand-written copy (another name, default or
help) fails here."""

import argparse
import dataclasses

import pytest

from eaglewire.bench.run import config_label, parse_configs
from eaglewire.cli import build_parser
from eaglewire.core.configs import config_from_args, config_to_args
from eaglewire.decode.engine import SpecConfig
from eaglewire.serve.app import ServeConfig, add_serve_args


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
    extra = {s for s in actions if any(w in s for w in ("topk", "draft-tokens", "min-prob", "spec"))}
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
