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
