"""Command-line flags generated from a dataclass's fields, and the dataclass's values read back from parsed flags.

A field's default, type and help are written once, on the field; its metadata says how it appears as a flag:

- `help`: the text (required);
- `flag`: the option string where it is not `--field-name` (`OffloadConfig.mode` is `--offload`);
- `unit`: the unit the flag takes where it is not the field's own (`"MiB"` for a `*_bytes` field: a float, read
  back as whole bytes);
- `choices`: the values the flag accepts;
- `group`: the argument group the flag joins where it is not the dataclass's own (`expert_storage`: `"method"`);
- `exclusive`: fields that share this name are mutually exclusive flags;
- `no_flag`: why the field has no flag (another flag or the job sets it); such a field is skipped.

A job that takes a few of a dataclass's fields as flags names them (`names=`): those fields, in that order, whatever
their metadata group (generate's and estimate's offload flags are `OffloadConfig` fields picked this way).

A `bool | None` field is a choice of auto/on/off (auto: None), as the CLI spells its other switches
(`--gradient-checkpointing`, generate's `--pregate`); a `bool` field one of on/off.

transformers' `HfArgumentParser` (5.x) is not used: it is a parser subclass that adds a dataclass's fields to itself
or to the one group the class names (`_argument_group_name`; the per-field step is private), which fits neither the
subcommands' parsers (`cli.build_parser`) nor a dataclass whose flags sit in two groups; it hands every metadata key
to `add_argument` (so no renames beside aliases, no units, no keys of this module's own), declares `--field_name`
beside `--field-name`, reads `bool | None` as true/false strings with no "auto", and has no way to leave a field out
but `init=False` (`compute_dtype: torch.dtype | None` would become a flag whose type is `torch.dtype`). What the
jobs need is the few lines below.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Iterator, Sequence

UNITS = {"MiB": 2**20}
EVERY_GROUP = "*"
SWITCH = {"auto": None, "on": True, "off": False}


def option(f: dataclasses.Field) -> str:
    """The field's option string."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def dest(f: dataclasses.Field) -> str:
    """The attribute the parsed flag is stored in (argparse's own, from the option string)."""
    return option(f)[2:].replace("-", "_")


def flag_fields(cls: type, group: str | None = EVERY_GROUP,
                names: Sequence[str] | None = None) -> Iterator[tuple[dataclasses.Field, type]]:
    """(field, value type) of every field of `cls` that is a flag, in declaration order; with `group`, only those
    whose metadata `group` is it (None: the dataclass's own group); with `names`, only those fields, in that order,
    whatever their group (a name that is no field, or a field with no flag, is a TypeError). The value type drops
    `None` from a union."""
    hints = typing.get_type_hints(cls)
    if names is not None:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in names:
            if name not in fields:
                raise TypeError(f"{cls.__name__} has no field {name!r}")
            if "no_flag" in fields[name].metadata:
                raise TypeError(f"{cls.__name__}.{name} has no flag: {fields[name].metadata['no_flag']}")
        selected = [fields[name] for name in names]
    else:
        selected = [f for f in dataclasses.fields(cls) if "no_flag" not in f.metadata
                    and (group == EVERY_GROUP or f.metadata.get("group") == group)]
    for f in selected:
        if not f.metadata.get("help"):
            raise TypeError(f"{cls.__name__}.{f.name}: a flag needs metadata['help'] (or metadata['no_flag'])")
        hint = hints[f.name]
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            members = [t for t in typing.get_args(hint) if t is not type(None)]
            if len(members) != 1:
                raise TypeError(f"{cls.__name__}.{f.name}: {hint} has no single flag type; mark it no_flag")
            hint = members[0]
        yield f, hint


def add_dataclass_arguments(group, cls: type, only: str | None = None, defaults: dict[str, Any] | None = None,
                            notes: dict[str, str] | None = None, names: Sequence[str] | None = None) -> None:
    """A flag in argparse `group` for each field of `cls` whose metadata `group` is `only` (None: the fields without
    one), or with `names`, for those fields, in that order, whatever their group (not both). `defaults`: a job's own
    default per field name, as the dataclass takes it (bytes, not MiB); `notes`: what a job adds to a field's help
    (e.g. where its default directory is)."""
    if only is not None and names is not None:
        raise TypeError("add_dataclass_arguments: give `only` (a metadata group) or `names`, not both")
    defaults, notes = defaults or {}, notes or {}
    unknown = (set(defaults) | set(notes)) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(unknown))} (defaults=/notes=)")
    hints = typing.get_type_hints(cls)
    exclusive: dict[str, Any] = {}
    for f, kind in flag_fields(cls, only, names):
        default = flag_value(f, kind, defaults.get(f.name, f.default))
        help_text = f.metadata["help"]
        unit = f.metadata.get("unit")
        if kind is bool:
            optional = type(None) in typing.get_args(hints[f.name])
            kwargs = dict(choices=tuple(SWITCH) if optional else ("on", "off"), default=default)
            help_text += " (auto: None, on: True, off: False)" if optional else " (on: True, off: False)"
        elif unit:
            kwargs = dict(type=float, default=default, metavar=unit.upper())
            help_text += f" (the flag takes {unit})"
        else:
            kwargs = dict(type=kind, default=default, choices=f.metadata.get("choices"))
        if f.name in notes:
            help_text += f"; {notes[f.name]}"
        target = group
        if "exclusive" in f.metadata:
            if f.metadata["exclusive"] not in exclusive:
                exclusive[f.metadata["exclusive"]] = group.add_mutually_exclusive_group()
            target = exclusive[f.metadata["exclusive"]]
        target.add_argument(option(f), dest=dest(f), help=help_text.replace("%", "%%"), **kwargs)


def flag_value(f: dataclasses.Field, kind: type, value: Any) -> Any:
    """Field `f`'s `value` as its flag spells it (`kind`: the value type `flag_fields` gives)."""
    if kind is bool:
        return next(name for name, v in SWITCH.items() if v is value)
    if f.metadata.get("unit") and value is not None:
        return value / UNITS[f.metadata["unit"]]
    return value


def dataclass_values(cls: type, args: argparse.Namespace, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The values of `cls`'s fields that the parsed `args` hold (fields whose flag this parser has), as the dataclass
    takes them: units converted back, auto/on/off as None/True/False. With `names` (the fields a job gave as flags,
    `add_dataclass_arguments(names=)`), only those, each required: a job's own flag that shares a field's destination
    (generate's `--offload`, with a `none` that `OffloadConfig.mode` lacks) is not read as the field."""
    values = {}
    for f, kind in flag_fields(cls, names=names):
        if not hasattr(args, dest(f)):
            if names is not None:
                raise TypeError(f"the parsed arguments have no {option(f)} ({cls.__name__}.{f.name})")
            continue
        value = getattr(args, dest(f))
        if kind is bool:
            value = SWITCH[value]
        elif f.metadata.get("unit") and value is not None:
            value = int(value * UNITS[f.metadata["unit"]])
        values[f.name] = value
    return values


def option_names(cls: type) -> dict[str, str]:
    """Field name -> option string, for the fields that are flags (to name the flag in an error about the field)."""
    return {f.name: option(f) for f, _ in flag_fields(cls)}
