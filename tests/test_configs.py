import argparse
import json
from dataclasses import dataclass, field

import pytest

from eaglewire.core.configs import (RESOLVED_CONFIG, ConfigError, add_config_args, config_from_args, config_from_mapping,
                               config_record, config_to_args, load_config_file, write_resolved_config)


@dataclass(kw_only=True)
class Demo:
    out: str = field(metadata={"help": "where"})
    steps: int = 3
    rate: float | None = None
    bounds: list[int] | None = None
    names: list[str] | None = None
    flag: bool = False
    resume: bool = field(default=False, metadata={"record": False})


def parser_of(cls) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls)
    return parser


def parse(argv, cls=None):
    cls = cls or Demo
    return config_from_args(cls, parser_of(cls).parse_args(argv))


def test_flags_follow_the_dataclass():
    assert parse(["--out", "x"]) == Demo(out="x")
    got = parse(["--out", "x", "--steps", "5", "--rate", "0.5", "--bounds", "2,15,27", "--names", "a,b", "--flag"])
    assert got == Demo(out="x", steps=5, rate=0.5, bounds=[2, 15, 27], names=["a", "b"], flag=True)


def test_required_and_malformed(capsys):
    with pytest.raises(ConfigError, match=r"missing --out: give it on the command line or as out: in a --config file"):
        parse([])
    with pytest.raises(SystemExit):
        parse(["--out", "x", "--bounds", "2,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    help_text = parser_of(Demo).format_help()
    assert "where (required)" in help_text and "--config FILE" in help_text


@dataclass(kw_only=True)
class Inner:
    depth: int = field(default=2, metadata={"flag": "outer-depth", "help": "how deep"})
    rate: float = 0.5


@dataclass(kw_only=True)
class Outer:
    name: str = "n"
    inner: Inner = field(default_factory=Inner)


def test_a_nested_dataclass_adds_its_fields_under_their_flag_names():
    parser = parser_of(Outer)
    assert config_from_args(Outer, parser.parse_args([])) == Outer()
    got = config_from_args(Outer, parser.parse_args(["--outer-depth", "7", "--name", "m"]))
    assert got == Outer(name="m", inner=Inner(depth=7))
    assert "--depth" not in parser.format_help() and "how deep (default: 2)" in parser.format_help()


def test_config_to_args_is_the_inverse_of_config_from_args():
    for config in (Outer(), Outer(name="m", inner=Inner(depth=7, rate=0.25))):
        assert config_from_args(Outer, parser_of(Outer).parse_args(config_to_args(config))) == config
    demo = Demo(out="x", bounds=[2, 15], flag=True)
    assert config_to_args(demo) == ["--out", "x", "--steps", "3", "--bounds", "2,15", "--flag", "--no-resume"]


@dataclass(kw_only=True)
class Command:
    action: str = field(metadata={"positional": True, "choices": ("go", "stay"), "help": "what"})
    stop: list[str] | None = field(default=None, metadata={"repeat": True, "help": "repeatable"})
    mode: str = field(default="a", metadata={"choices": ("a", "b")})


def test_positional_choices_and_repeated_flags():
    assert parse(["go", "--stop", "a,b", "--stop", "c"], Command) == Command(action="go", stop=["a,b", "c"])
    assert config_from_args(Command, parser_of(Command).parse_args(config_to_args(Command(action="stay", stop=["x"])))) \
        == Command(action="stay", stop=["x"])
    with pytest.raises(ConfigError, match="ACTION 'run' is not one of go, stay"):
        parse(["run"], Command)
    with pytest.raises(ConfigError, match="missing ACTION"):
        parse([], Command)
    assert "{go,stay}" in parser_of(Command).format_help()


# ---------------------------------------------------------------- --config files

@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_config_file_sets_values_and_flags_override_it(tmp_path, suffix):
    values = {"out": "x", "steps": 5, "bounds": [2, 15], "flag": True, "inner": {"rate": 0.25}}
    path = tmp_path / f"run{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(values))
    else:
        path.write_text("out: x\nsteps: 5\nbounds: [2, 15]\nflag: true\ninner:\n  rate: 0.25\n")
    assert load_config_file(path) == values

    @dataclass(kw_only=True)
    class Both:
        out: str
        steps: int = 3
        bounds: list[int] | None = None
        flag: bool = False
        inner: Inner = field(default_factory=Inner)

    assert parse(["--config", str(path)], Both) == Both(out="x", steps=5, bounds=[2, 15], flag=True,
                                                         inner=Inner(rate=0.25))
    got = parse(["--config", str(path), "--steps", "9", "--no-flag", "--outer-depth", "4"], Both)
    assert got == Both(out="x", steps=9, bounds=[2, 15], flag=False, inner=Inner(depth=4, rate=0.25))


def test_keys_may_be_spelled_as_flags():
    assert config_from_mapping(Outer, {"outer-depth": 4}) == Outer(inner=Inner(depth=4))  # a nested flag, flat
    assert config_from_mapping(Outer, {"inner": {"depth": 4}}) == Outer(inner=Inner(depth=4))
    assert config_from_mapping(Demo, {"out": "x", "bounds": "2,15"}) == Demo(out="x", bounds=[2, 15])
    assert config_from_mapping(Demo, {"out": "x", "rate": 1}) == Demo(out="x", rate=1.0)  # an integer is a number
    with pytest.raises(ConfigError, match="inner.depth is given twice"):
        config_from_mapping(Outer, {"outer-depth": 4, "inner": {"depth": 5}})


def test_unknown_keys_name_the_key_and_close_matches():
    with pytest.raises(ConfigError, match=r"run.yaml: unknown key 'stepz'; did you mean steps\?"):
        config_from_mapping(Demo, {"out": "x", "stepz": 4}, where="run.yaml")
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'; the keys are: bounds, flag, names, out, rate"):
        config_from_mapping(Demo, {"zzz": 1})
    with pytest.raises(ConfigError, match=r"inner: unknown key 'dept'; did you mean depth"):
        config_from_mapping(Outer, {"inner": {"dept": 1}}, where="f")


@pytest.mark.parametrize("key, value, expected", [
    ("steps", "5", "an integer"), ("steps", 2.5, "an integer"), ("steps", True, "an integer"),
    ("flag", "yes", "true or false"), ("flag", 1, "true or false"), ("out", 3, "a string"),
    ("bounds", [2, "x"], "a list of integers or null"), ("bounds", "2,x", "a list of integers or null"),
    ("steps", None, "an integer"),
])
def test_wrong_types_name_the_key_and_the_type(key, value, expected):
    with pytest.raises(ConfigError, match=f"f.yaml: {key} must be {expected}, got"):
        config_from_mapping(Demo, {"out": "x", key: value}, where="f.yaml")


def test_choices_are_checked_in_files_too():
    with pytest.raises(ConfigError, match="mode 'c' is not one of a, b"):
        config_from_mapping(Command, {"action": "go", "mode": "c"})


def test_bad_files_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="--config .*nope.yaml: no such file"):
        load_config_file(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("out: [x\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config_file(tmp_path / "bad.yaml")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a mapping of settings"):
        load_config_file(tmp_path / "list.json")
    (tmp_path / "empty.yaml").write_text("")
    assert load_config_file(tmp_path / "empty.yaml") == {}


def test_the_recorded_config_loads_back(tmp_path):
    config = Demo(out="x", steps=4, bounds=[1, 2], rate=None, flag=True, resume=True)
    path = write_resolved_config(tmp_path / "run", config)
    assert path == tmp_path / "run" / RESOLVED_CONFIG
    record = json.loads(path.read_text())
    assert "resume" not in record  # an instruction about the directory, not a setting of the run
    assert parse(["--config", str(path)]) == Demo(out="x", steps=4, bounds=[1, 2], flag=True)
    nested = Outer(inner=Inner(depth=9))
    assert config_record(nested) == {"name": "n", "inner": {"depth": 9, "rate": 0.5}}
    # a JSON report that records its config under resolved_config loads as that config
    (tmp_path / "report.json").write_text(json.dumps({"status": "passed", "resolved_config": config_record(nested)}))
    assert parse(["--config", str(tmp_path / "report.json")], Outer) == nested
