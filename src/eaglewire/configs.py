"""Turn a config dataclass into command-line flags and back: defaults live only in the dataclass.

Each field becomes ``--field-name`` (or ``--`` + ``field(metadata={"flag": ...})``, e.g. SGLang's
names on SpecConfig); its help text is ``field(metadata={"help": ...})``. A field whose type is a
dataclass (``spec: SpecConfig``) contributes that dataclass's flags, so a group of settings is
defined once and every command that takes it gets the same flags.
Supported field types: str, int, float, bool (``--x/--no-x``), ``list[int]`` and
``list[str]`` (comma separated), ``X | None`` of those, and dataclasses of those.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


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


def _parser_type(tp: Any):
    if tp in (int, float, str):
        return tp
    if typing.get_origin(tp) is list and typing.get_args(tp) == (int,):
        return _int_list
    if typing.get_origin(tp) is list and typing.get_args(tp) == (float,):
        return _float_list
    if typing.get_origin(tp) is list and typing.get_args(tp) == (str,):
        return _str_list
    raise TypeError(f"config field type {tp!r} has no command-line form")


def _cli_fields(cls: type):
    """(field, type, dest) of every field of ``cls`` that has a flag; dest is the flag's name in
    snake case, so ``--speculative-num-steps`` lands in ``args.speculative_num_steps``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        yield f, tp, f.metadata.get("flag", f.name.replace("_", "-")).replace("-", "_")


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of dataclass ``cls`` (a nested dataclass adds its own fields'
    flags); required fields have no default."""
    for f, tp, dest in _cli_fields(cls):
        if dataclasses.is_dataclass(tp):
            add_config_args(parser, tp)
            continue
        flag = "--" + dest.replace("_", "-")
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f.metadata.get("help", "")
        if has_default:
            help_text += f" (default: {default})"
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, dest=dest,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=_parser_type(tp), required=not has_default, dest=dest,
                                default=argparse.SUPPRESS, help=help_text)


def _given(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments of ``cls`` among the flags ``given`` (nested dataclasses only
    when one of their flags was given, so they keep their own default otherwise)."""
    kwargs: dict[str, Any] = {}
    for f, tp, dest in _cli_fields(cls):
        if dataclasses.is_dataclass(tp):
            inner = _given(tp, given)
            if inner:
                kwargs[f.name] = tp(**inner)
        elif dest in given:
            kwargs[f.name] = given[dest]
    for f in dataclasses.fields(cls):  # fields without a flag of their own (cli=False): set by the command
        if f.init and f.metadata.get("cli") is False and f.name in given:
            kwargs[f.name] = given[f.name]
    return kwargs


def config_from_args(cls: type, args: argparse.Namespace):
    """Build ``cls`` from the flags that were given; the rest keep the dataclass defaults."""
    return cls(**_given(cls, vars(args)))


def config_to_args(config: Any) -> list[str]:
    """The flags that rebuild ``config`` (a dataclass) through ``config_from_args``: the inverse,
    for command lines printed for the user (every value spelled out; None fields left out)."""
    out: list[str] = []
    for f, tp, dest in _cli_fields(type(config)):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(tp):
            out += config_to_args(value)
            continue
        flag = "--" + dest.replace("_", "-")
        if tp is bool:
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            text = ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else str(value)
            out += [flag, text]
    return out
