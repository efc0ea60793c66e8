"""Command-line flags from the settings' dataclass fields: one flag per field, with its default and help; and what
the bench, plan and simulate commands share: the ``--allow-busy`` flag and where a run's result JSON goes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default:" in action.help:
            return action.help
        return super()._get_help_string(action)


def _flag_type(hint: Any) -> tuple[Any, tuple[str, ...] | None]:
    """argparse ``type`` and ``choices`` of a field's type hint (``int | None`` -> int)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        return str, tuple(typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if all(typing.get_origin(a) is Literal for a in args):
            return str, tuple(v for a in args for v in typing.get_args(a))
        return (args[0] if len(args) == 1 else str), None
    return hint, None


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    include: tuple[str, ...] | None = None) -> None:
    """One flag per field of the dataclass ``cls`` (``max_num_seqs`` -> ``--max-num-seqs``), with the
    field's default and help; booleans get ``--x/--no-x``. ``include`` picks a subset of fields."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli", True) is False or (include is not None and f.name not in include):
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        default = f.default
        if "env" in f.metadata:
            default = os.environ.get(f.metadata["env"], default)
        if hints[f.name] is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"])
            continue
        kind, choices = _flag_type(hints[f.name])
        kind = f.metadata.get("type", kind)  # a field whose flag is parsed from text (JSON, say)
        nargs = {"nargs": f.metadata["nargs"]} if "nargs" in f.metadata else {}
        parser.add_argument(flag, dest=f.name, type=kind, choices=choices, default=default, help=f.metadata["help"],
                            **nargs)


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Build ``cls`` from the parsed flags that :func:`add_config_args` added (fields without a flag keep
    their defaults unless given in ``overrides``)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**given, **overrides})


def add_allow_busy_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--allow-busy", action="store_true",
                   help="draw timing figures even when other processes kept the machine busy during the run "
                        "(refused by default; the figure's stamp says busy)")


def write_json(path: str, result: dict[str, Any]) -> None:
    """One run's result as a JSON file, its folder made."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {path}")


def sibling_path(json_path: str, suffix: str) -> Path:
    """Where a chart goes beside a result JSON: its stem with ``suffix``."""
    p = Path(json_path)
    return p.with_name(f"{p.stem}{suffix}")
