import argparse
from dataclasses import dataclass, field

import pytest

from eaglewire.configs import add_config_args, config_from_args


@dataclass(kw_only=True)
class Demo:
    out: str = field(metadata={"help": "where"})
    steps: int = 3
    rate: float | None = None
    bounds: list[int] | None = None
    names: list[str] | None = None
    flag: bool = False


def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_args(parser, Demo)
    return config_from_args(Demo, parser.parse_args(argv))


def test_flags_follow_the_dataclass():
    assert parse(["--out", "x"]) == Demo(out="x")
    got = parse(["--out", "x", "--steps", "5", "--rate", "0.5", "--bounds", "2,15,27", "--names", "a,b", "--flag"])
    assert got == Demo(out="x", steps=5, rate=0.5, bounds=[2, 15, 27], names=["a", "b"], flag=True)


def test_required_and_malformed(capsys):
    with pytest.raises(SystemExit):
        parse([])
    with pytest.raises(SystemExit):
        parse(["--out", "x", "--bounds", "2,x"])
    assert "comma-separated integers" in capsys.readouterr().err


@dataclass(kw_only=True)
class Inner:
    depth: int = field(default=2, metadata={"flag": "outer-depth", "help": "how deep"})
    rate: float = 0.5


@dataclass(kw_only=True)
class Outer:
    name: str = "n"
    inner: Inner = field(default_factory=Inner)


def test_a_nested_dataclass_adds_its_fields_under_their_flag_names():
    parser = argparse.ArgumentParser()
    add_config_args(parser, Outer)
    assert config_from_args(Outer, parser.parse_args([])) == Outer()
    got = config_from_args(Outer, parser.parse_args(["--outer-depth", "7", "--name", "m"]))
    assert got == Outer(name="m", inner=Inner(depth=7))
    assert "--depth" not in parser.format_help() and "how deep (default: 2)" in parser.format_help()


def test_config_to_args_is_the_inverse_of_config_from_args():
    from eaglewire.configs import config_to_args

    for config in (Outer(), Outer(name="m", inner=Inner(depth=7, rate=0.25))):
        parser = argparse.ArgumentParser()
        add_config_args(parser, Outer)
        assert config_from_args(Outer, parser.parse_args(config_to_args(config))) == config
    demo = Demo(out="x", bounds=[2, 15], flag=True)
    assert config_to_args(demo) == ["--out", "x", "--steps", "3", "--bounds", "2,15", "--flag"]
