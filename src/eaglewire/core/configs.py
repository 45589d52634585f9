"""Config dataclasses as command-line flags and as ``--config`` files: defaults live only in the dataclass.

Each field becomes ``--field-name`` (or ``--`` + ``field(metadata={"flag": ...})``, e.g. SGLang's
names on SpecConfig); its help text is ``field(metadata={"help": ...})``. A field whose type is a
dataclass (``spec: SpecConfig``) contributes that dataclass's flags, so a group of settings is
defined once and every command that takes it gets the same flags.
Supported field types: str, int, float, bool (``--x/--no-x``), ``list[int]``, ``list[float]`` and
``list[str]`` (comma separated), ``X | None`` of those, and dataclasses of those.
More metadata: ``choices`` (a tuple of allowed values), ``positional`` (an argument without a
``--``), ``repeat`` (a ``list[str]`` flag given once per item, e.g. ``--stop``), ``record=False``
(an instruction about the run directory such as ``--resume``, not a setting: left out of the
recorded config).

``--config FILE`` (YAML or JSON) gives the same settings as a mapping: keys are the field names
(or their flag spelling, dashes allowed), a nested dataclass is a nested mapping (or its flags'
names at the top level); flags given on the command line override the file. Every run directory
records the config it resolved (``resolved_config.json``; ``resolved_config`` inside a JSON
report), and that file loads back with ``--config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any

CONFIG_DEST = "config_file"  # where argparse keeps --config FILE (no config field may be named so)
RESOLVED_CONFIG = "resolved_config.json"  # the resolved config in a run directory
RESOLVED_KEY = "resolved_config"  # ... and inside a JSON report (doctor --json, tune.json)

Path_ = tuple[str, ...]  # field names from the outer config to a setting


class ConfigError(ValueError):
    """A --config file or a flag that does not fit the command's config; says which and why."""


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _number_list(cast: type, what: str):
    """A flag parser of comma-separated ``cast`` values (``what`` names them in the error)."""
    def parse(text: str) -> list:
        try:
            return [cast(x) for x in text.replace(" ", "").split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
    return parse


_int_list = _number_list(int, "integers")
_float_list = _number_list(float, "numbers")


def _str_list(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def _item_type(tp: Any) -> type | None:
    """The element type of ``list[X]``, None for a scalar."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _parser_type(tp: Any):
    if tp in (int, float, str):
        return tp
    parsers = {int: _int_list, float: _float_list, str: _str_list}
    if _item_type(tp) in parsers:
        return parsers[_item_type(tp)]
    raise TypeError(f"config field type {tp!r} has no command-line form")


@dataclasses.dataclass(frozen=True)
class _Setting:
    field: dataclasses.Field
    tp: Any  # the type without its `| None`
    optional: bool
    dest: str  # the flag's name in snake case: --speculative-num-steps -> speculative_num_steps

    @property
    def flag(self) -> str:
        """How the command line spells it: ``--name``, or ``NAME`` for a positional argument."""
        return self.dest.upper() if self.positional else "--" + self.dest.replace("_", "-")

    @property
    def positional(self) -> bool:
        return bool(self.field.metadata.get("positional"))

    @property
    def nested(self) -> bool:
        return dataclasses.is_dataclass(self.tp)

    @property
    def required(self) -> bool:
        return self.field.default is dataclasses.MISSING and self.field.default_factory is dataclasses.MISSING

    @property
    def default(self) -> Any:
        f = self.field
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _settings(cls: type) -> list[_Setting]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, optional = _unwrap_optional(hints[f.name])
        dest = f.metadata.get("flag", f.name).replace("-", "_")
        if dest == CONFIG_DEST:
            raise TypeError(f"{cls.__name__}.{f.name}: the flag name {dest!r} is --config's own")
        out.append(_Setting(f, tp, optional, dest))
    return out


def _leaves(cls: type, prefix: Path_ = ()) -> list[tuple[Path_, _Setting]]:
    """Every non-dataclass setting of ``cls``, nested ones included, with its path of field names."""
    out = []
    for s in _settings(cls):
        path = prefix + (s.field.name,)
        out += _leaves(s.tp, path) if s.nested else [(path, s)]
    return out


# ---------------------------------------------------------------- flags

def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add ``--config FILE`` and one flag per field of dataclass ``cls`` (a nested dataclass adds
    its own fields' flags). No flag has an argparse default, so what was given is known; required
    fields are checked when the config is built (they may come from the file)."""
    if "--config" not in parser._option_string_actions:
        parser.add_argument("--config", dest=CONFIG_DEST, metavar="FILE", default=argparse.SUPPRESS,
                            help="YAML or JSON file of these settings: keys are the flags' names (dashes "
                                 "or underscores); flags given here override it")
    for _, s in _leaves(cls):
        help_text = s.field.metadata.get("help", "")
        if s.required:
            help_text += " (required)"
        elif "default" not in help_text:  # else the help says what the default means
            help_text += f" (default: {s.default})"
        choices = s.field.metadata.get("choices")
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        if s.tp is bool:
            parser.add_argument(s.flag, action=argparse.BooleanOptionalAction, dest=s.dest, **kwargs)
        elif s.field.metadata.get("repeat"):
            parser.add_argument(s.flag, action="append", dest=s.dest, **kwargs)
        elif s.positional:  # optional for argparse: a --config file may give it; argparse checks no
            # choices here (it would check the absent default), _flag_values does
            metavar = "{" + ",".join(choices) + "}" if choices else s.flag
            parser.add_argument(s.dest, nargs="?", type=_parser_type(s.tp), metavar=metavar, **kwargs)
        else:
            parser.add_argument(s.flag, type=_parser_type(s.tp), choices=choices, dest=s.dest, **kwargs)


def _flag_values(cls: type, given: dict[str, Any]) -> dict[Path_, Any]:
    """The settings of ``cls`` among the parsed flags ``given``."""
    out = {}
    for path, s in _leaves(cls):
        if s.dest in given:
            out[path] = _checked_choice(given[s.dest], s, s.flag, "the command line") if s.positional else given[s.dest]
    return out


def config_from_args(cls: type, args: argparse.Namespace):
    """Build ``cls`` from ``--config FILE`` (when given) and the flags given, which override the
    file; the rest keep the dataclass defaults."""
    given = vars(args)
    values: dict[Path_, Any] = {}
    if given.get(CONFIG_DEST):
        values = _file_values(cls, load_config_file(given[CONFIG_DEST]), where=f"--config {given[CONFIG_DEST]}")
    values.update(_flag_values(cls, given))
    return _build(cls, values)


def _build(cls: type, values: dict[Path_, Any], prefix: Path_ = ()):
    kwargs: dict[str, Any] = {}
    missing = []
    for s in _settings(cls):
        path = prefix + (s.field.name,)
        if s.nested:
            if any(p[:len(path)] == path for p in values):  # else it keeps its own default
                kwargs[s.field.name] = _build(s.tp, values, path)
        elif path in values:
            kwargs[s.field.name] = values[path]
        elif s.required:
            missing.append(s)
    if missing:
        names = ", ".join(s.flag for s in missing)
        keys = ", ".join(f"{s.field.name}:" for s in missing)
        raise ConfigError(f"missing {names}: give {'it' if len(missing) == 1 else 'them'} on the command line "
                          f"or as {keys} in a --config file")
    return cls(**kwargs)


def config_to_args(config: Any) -> list[str]:
    """The flags that rebuild ``config`` (a dataclass) through ``config_from_args``: the inverse,
    for command lines printed for the user (every value spelled out; None fields left out)."""
    out: list[str] = []
    for s in _settings(type(config)):
        value = getattr(config, s.field.name)
        if s.nested:
            out += config_to_args(value)
        elif s.tp is bool:
            out.append(s.flag if value else "--no-" + s.flag[2:])
        elif value is None:
            continue
        elif s.field.metadata.get("repeat"):
            out += [x for item in value for x in (s.flag, item)]
        else:
            text = ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else str(value)
            out += [text] if s.positional else [s.flag, text]
    return out


# ---------------------------------------------------------------- --config files

def load_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML or JSON file (``.json``: JSON, else YAML, of which JSON is a subset).
    A JSON report that records its run's config under ``resolved_config`` gives that config."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path}: no such file; give a YAML or JSON file of settings") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError: the parser says where
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise ConfigError(f"--config {path}: not valid {kind}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings (key: value), got {type(data).__name__}")
    if isinstance(data.get(RESOLVED_KEY), dict):
        return data[RESOLVED_KEY]
    return data


def config_from_mapping(cls: type, mapping: dict[str, Any], *, where: str = "config"):
    """Build ``cls`` from a mapping as a --config file holds it (``where`` names it in errors)."""
    return _build(cls, _file_values(cls, mapping, where=where))


def _spellings(cls: type) -> dict[str, tuple[Path_, _Setting]]:
    """Every key that names a setting of ``cls`` at this level: own fields by name or flag (dashes
    or underscores), nested dataclasses' settings by their flag names."""
    out = {}
    for path, s in _leaves(cls):
        names = {s.dest, s.dest.replace("_", "-")}
        if len(path) == 1:
            names |= {s.field.name, s.field.name.replace("_", "-")}
        for name in names:
            out[name] = (path, s)
    return out


def _file_values(cls: type, mapping: dict[str, Any], *, where: str) -> dict[Path_, Any]:
    nested = {s.field.name: s for s in _settings(cls) if s.nested}
    nested |= {k.replace("_", "-"): s for k, s in nested.items()}
    spellings = _spellings(cls)
    out: dict[Path_, Any] = {}
    seen: dict[Path_, str] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {key!r} is not a setting name; keys are field names such as "
                              f"{next(iter(spellings), 'out')}")
        if key in nested and isinstance(value, dict):
            s = nested[key]
            inner = _file_values(s.tp, value, where=f"{where}: {key}")
            found = {(s.field.name,) + p: v for p, v in inner.items()}
        elif key in spellings:
            path, s = spellings[key]
            found = {path: _checked(value, s, key, where)}
        else:
            raise ConfigError(_unknown(key, cls, where))
        for path, v in found.items():
            if path in seen:
                raise ConfigError(f"{where}: {'.'.join(path)} is given twice (as {seen[path]!r} and {key!r}); keep one")
            seen[path], out[path] = key, v
    return out


def _unknown(key: str, cls: type, where: str) -> str:
    names = sorted({s.field.name for s in _settings(cls)} | {s.dest for _, s in _leaves(cls)})
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"the keys are: {', '.join(names)}"
    return f"{where}: unknown key {key!r}; {hint}"


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _type_name(s: _Setting) -> str:
    item = _item_type(s.tp)
    name = f"a list of {_TYPE_NAMES[item].removeprefix('a ').removeprefix('an ')}s" if item else _TYPE_NAMES[s.tp]
    return name + " or null" if s.optional else name


def _scalar(value: Any, tp: type) -> tuple[bool, Any]:
    """(fits, value as ``tp``): an integer is a number, a bool is no integer."""
    if isinstance(value, bool):
        return tp is bool, value
    if tp is float and isinstance(value, (int, float)):
        return True, float(value)
    return isinstance(value, tp), value


def _checked(value: Any, s: _Setting, key: str, where: str) -> Any:
    """``value`` from a file as setting ``s`` expects it, or an error naming the key and the type."""
    def wrong() -> ConfigError:
        return ConfigError(f"{where}: {key} must be {_type_name(s)}, got {value!r} ({type(value).__name__})")

    if value is None:
        if s.optional:
            return None
        raise wrong()
    item = _item_type(s.tp)
    if item is not None:
        if isinstance(value, str):  # the flag's spelling: "2,15,27" (a repeated flag: one item)
            if s.field.metadata.get("repeat"):
                return [value]
            try:
                return _parser_type(s.tp)(value)
            except argparse.ArgumentTypeError:
                raise wrong() from None
        if not isinstance(value, list):
            raise wrong()
        items = [_scalar(v, item) for v in value]
        if not all(ok for ok, _ in items):
            raise wrong()
        return [v for _, v in items]
    ok, value = _scalar(value, s.tp)
    if not ok:
        raise wrong()
    return _checked_choice(value, s, key, where)


def _checked_choice(value: Any, s: _Setting, key: str, where: str) -> Any:
    choices = s.field.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: {key} {value!r} is not one of {', '.join(map(str, choices))}")
    return value


# ---------------------------------------------------------------- the record of a run

def config_record(config: Any) -> dict[str, Any]:
    """``config`` as a --config mapping: every setting by field name, nested dataclasses nested;
    fields marked ``record=False`` (instructions such as ``resume``) are left out."""
    out: dict[str, Any] = {}
    for s in _settings(type(config)):
        if s.field.metadata.get("record", True) is False:
            continue
        value = getattr(config, s.field.name)
        out[s.field.name] = config_record(value) if s.nested else list(value) if isinstance(value, list) else value
    return out


def write_resolved_config(directory: str | Path, config: Any) -> Path:
    """Record ``config`` in run directory ``directory`` as ``resolved_config.json`` (atomically);
    ``--config`` reads it back."""
    from eaglewire.core.fileio import atomic_write_json

    path = Path(directory) / RESOLVED_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, config_record(config))
    return path
