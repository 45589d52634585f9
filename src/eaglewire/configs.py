"""Turn a config dataclass into command-line flags and back: defaults live only in the dataclass.

Each field becomes ``--field-name``; its help text is ``field(metadata={"help": ...})``.
Supported field types: str, int, float, bool (``--x/--no-x``), ``list[int]`` and
``list[str]`` (comma separated) and ``X | None`` of those.
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


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def _parser_type(tp: Any):
    if tp in (int, float, str):
        return tp
    if typing.get_origin(tp) is list and typing.get_args(tp) == (int,):
        return _int_list
    if typing.get_origin(tp) is list and typing.get_args(tp) == (str,):
        return _str_list
    raise TypeError(f"config field type {tp!r} has no command-line form")


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of dataclass ``cls``; required fields have no default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, _ = _unwrap_optional(hints[f.name])
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f.metadata.get("help", "")
        if has_default:
            help_text += f" (default: {default})"
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=_parser_type(tp), required=not has_default,
                                default=argparse.SUPPRESS, help=help_text)


def config_from_args(cls: type, args: argparse.Namespace):
    """Build ``cls`` from the flags that were given; the rest keep the dataclass defaults."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in vars(args).items() if k in names})
