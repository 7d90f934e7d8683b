"""The reference of every `OffloadConfig` field and every command-line flag, generated from the code.

The fields come from the dataclass (name, annotated type, default, the `help` of its field metadata, in the manner of
peft's configs); the flags from `hf_moe_offload.cli.main.build_parser()` (each subcommand's argument groups and actions:
flags, default, choices, help). `docs/reference.md` is this module's output:

    python -m hf_moe_offload.cli.reference docs/reference.md

and tests/test_reference.py regenerates it and compares, so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import textwrap

from ..errors import UserError, add_debug_flag, run_reporting_errors

REGENERATE = "python -m hf_moe_offload.cli.reference docs/reference.md"


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename: a reader sees the old file or
    the new one, never a part."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {path}: the folder {folder} does not exist (create it, or give another path)")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def cell(text: str) -> str:
    """`text` as one markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _wrap(line: str, width: int = 120) -> str:
    """A prose line wrapped at `width` (the docs' width); table rows, headings and indented blocks as they are."""
    if line.startswith(("|", "#", " ")):
        return line
    item = re.match(r"(\d+\.|-) ", line)  # a list item's continuation lines are indented under its text
    indent = " " * len(item.group(0)) if item else ""
    return textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _code(value: object) -> str:
    return f"`{value}`"


# --- OffloadConfig ---

def config_rows() -> list[tuple[str, str, str, str]]:
    """(name, type, default, help) of every `OffloadConfig` field, in declaration order. A field without help text
    is an error: the reference is the fields' documentation."""
    from ..offload.config import OffloadConfig

    rows = []
    for f in dataclasses.fields(OffloadConfig):
        help_text = f.metadata.get("help")
        if not help_text:
            raise UserError(f"OffloadConfig.{f.name} has no help text: add field(metadata={{'help': ...}}) to it in "
                            "hf_moe_offload/offload/config.py")
        if f.default is not dataclasses.MISSING:
            default = _code(repr(f.default))
        elif f.default_factory is not dataclasses.MISSING:
            default = _code(repr(f.default_factory()))
        else:
            default = "required"
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        rows.append((_code(f.name), _code(type_name), default, help_text))
    return rows


def _render_config() -> list[str]:
    from ..offload.config import OffloadConfig

    summary = (OffloadConfig.__doc__ or "").strip().split("\n\n")[0]
    out = ["## `OffloadConfig`", "",
           f"`hf_moe_offload.OffloadConfig` (hf_moe_offload/offload/config.py): {summary[0].lower() + summary[1:]} "
           "Pass it to `enable_expert_offload(model, config)` or `load_offloaded_pretrained(path, config)`; "
           "an invalid value raises `ValueError` naming the field.", "",
           "```python", "from hf_moe_offload import OffloadConfig", "",
           "# Experts on disk behind a host cache of 8 experts, 2 read ahead; everything else at its default.",
           'config = OffloadConfig(mode="disk", offload_dir="/tmp/experts", host_cache_experts=8, prefetch_depth=2)',
           "```", "",
           "| field | type | default | what it does |", "|---|---|---|---|"]
    out += [f"| {name} | {cell(t)} | {cell(d)} | {cell(h)} |" for name, t, d, h in config_rows()]
    return out + [""]


# --- the command line ---

def _metavar(action: argparse.Action) -> str:
    """The value an option takes, as the user types it (argparse's own usage notation), or "" for a switch."""
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        name = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        name = action.dest.upper()
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs == "+":
        return f"{name} [{name} ...]"
    if action.nargs == "*":
        return f"[{name} ...]"
    if isinstance(action.nargs, int) and action.nargs > 1:
        return " ".join([name] * action.nargs)
    return name


def _flag(action: argparse.Action) -> str:
    value = _metavar(action)
    if not action.option_strings:  # a positional argument
        return _code(action.metavar or action.dest)
    names = ", ".join(action.option_strings)
    return _code(f"{names} {value}".strip())


def _default(action: argparse.Action) -> str:
    if not action.option_strings:
        return "required"
    if action.required:
        return "required"
    default = action.default
    if action.nargs == 0:  # a switch (store_true and the like): off unless given
        return "on" if default not in (None, False, argparse.SUPPRESS) else "off"
    if default is None or default is argparse.SUPPRESS:
        return "none"
    if isinstance(default, (list, tuple)):
        return _code(",".join(map(str, default)))
    return _code(default)


def _help(action: argparse.Action, prog: str) -> str:
    """The action's help with argparse's `%(default)s`-style fields expanded (as `--help` prints it)."""
    if not action.help:
        return ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return action.help % params


def _visible(action: argparse.Action) -> bool:
    return (action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
            and not isinstance(action, argparse._SubParsersAction))


def _render_actions(parser: argparse.ArgumentParser, heading: str) -> list[str]:
    """One table per argument group of `parser` that has a visible argument (the group's title as a heading when the
    parser has several)."""
    groups = [(g.title, [a for a in g._group_actions if _visible(a)]) for g in parser._action_groups]
    groups = [(title, actions) for title, actions in groups if actions]
    out = []
    for title, actions in groups:
        if len(groups) > 1:
            out += [f"{heading} {title}", ""]
        out += ["| argument | default | what it does |", "|---|---|---|"]
        for a in actions:
            what = cell(_help(a, parser.prog)) or "(no help text)"
            out.append(f"| {cell(_flag(a))} | {cell(_default(a))} | {what} |")
        out.append("")
    return out


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in the order `--help` lists them."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def _render_cli() -> list[str]:
    from .main import build_parser

    parser = build_parser()
    subs = _subcommands(parser)
    out = ["## The command line: `hf-moe-offload`", "",
           "`hf-moe-offload [OPTIONS] COMMAND [ARGUMENTS]` (hf_moe_offload/cli/main.py; also "
           "`python -m hf_moe_offload.cli.main`). An error of the user's prints one line naming the cause and the fix and "
           "exits with code 2 (`--debug`: the full traceback). The commands:", "",
           "| command | what it does |", "|---|---|"]
    out += [f"| [`{name}`](#hf-moe-offload-{name}) | {cell(h)} |" for name, h, _ in subs]
    out += ["", "### Options of every command", "",
            "Given before the command: `hf-moe-offload --log-level DEBUG train ...`.", ""]
    out += _render_actions(parser, "####")
    for name, help_text, sub in subs:
        out += [f"### `hf-moe-offload {name}`", "", f"{cell(help_text)[:1].upper()}{cell(help_text)[1:]}.", ""]
        out += _render_actions(sub, "####")
    return out


def render() -> str:
    """docs/reference.md's text."""
    lines = ["# Reference: `OffloadConfig` and the command line", "",
             "Every field of `OffloadConfig` and every argument of every `hf-moe-offload` command, with its default "
             "and what it does. This page is generated from the code (the dataclass's field metadata and "
             "`hf_moe_offload.cli.main.build_parser()`) by", "", f"    {REGENERATE}", "",
             "and tests/test_reference.py regenerates it and fails where it differs: edit the help texts in the "
             "code, then regenerate. How the settings combine, with examples: [offload.md](offload.md), "
             "[jobs.md](jobs.md), [estimate.md](estimate.md), [generation.md](generation.md).", "",
             "Contents: [`OffloadConfig`](#offloadconfig) · [the command line](#the-command-line-hf-moe-offload)", ""]
    lines += _render_config()
    lines += _render_cli()
    return join_markdown(lines)


def join_markdown(lines: list[str]) -> str:
    """`lines` as one markdown text, the prose wrapped (code blocks as they are)."""
    out, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
            out.append(line)
        else:
            out.append(line if fenced else _wrap(line))
    return "\n".join(out).rstrip("\n") + "\n"


def write(out: str | None) -> None:
    """Write the page to `out` (atomically), or print it where `out` is None."""
    text = render()
    if out is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(out, text)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m hf_moe_offload.cli.reference"
    parser = argparse.ArgumentParser(
        prog=prog, description="Write the reference of every OffloadConfig field and command-line flag.")
    parser.add_argument("out", nargs="?", help="the file to write, e.g. docs/reference.md (default: print the page)")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    return run_reporting_errors(lambda: write(args.out), prog, args.debug)


if __name__ == "__main__":
    sys.exit(main())
