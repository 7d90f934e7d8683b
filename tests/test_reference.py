"""docs/reference.md is what `hf_moe_offload.cli.reference` generates from the code (OffloadConfig's field metadata, the
CLI's parser), and it documents every field and every flag."""

from __future__ import annotations

import dataclasses
import os

import pytest

from hf_moe_offload import OffloadConfig
from hf_moe_offload.cli.main import build_parser
from hf_moe_offload.errors import UserError
from hf_moe_offload.cli.reference import REGENERATE, _subcommands, _visible, config_rows, main, render, write_text_atomic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "reference.md")


def test_committed_reference_is_the_generated_one():
    with open(PAGE, encoding="utf-8") as f:
        committed = f.read()
    assert committed == render(), f"docs/reference.md is out of date with the code: regenerate it with `{REGENERATE}`"


def test_every_field_and_every_flag_is_on_the_page():
    """Independent of the renderer's layout: each field name and each option string appears in a table row."""
    page = render()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    for f in dataclasses.fields(OffloadConfig):
        assert any(line.startswith(f"| `{f.name}` |") for line in rows), f.name
    parser = build_parser()
    subs = _subcommands(parser)
    assert {name for name, _, _ in subs} >= {"train", "estimate", "generate", "convert-fairseq", "push",
                                              "export-adapter"}
    for name, _, sub in [("", "", parser), *subs]:
        for action in sub._actions:
            if not _visible(action):
                continue
            names = action.option_strings or [action.metavar or action.dest]
            for option in names:
                assert any(f"`{option}" in line or f", {option}" in line for line in rows), (name, option)
            assert page.count(f"### `hf-moe-offload {name}`") == (1 if name else 0)


def test_every_flag_has_help():
    """The reference is the flags' documentation: a flag without help text is a flag nobody can look up."""
    missing = []
    parser = build_parser()
    for name, _, sub in [("(global)", "", parser), *_subcommands(parser)]:
        missing += [f"{name} {a.option_strings[0] if a.option_strings else a.dest}" for a in sub._actions
                    if _visible(a) and not a.help]
    assert not missing, (f"flags without help text (add help=... where they are declared, then `{REGENERATE}`): "
                         f"{', '.join(missing)}")


def test_defaults_and_help_are_the_parsers():
    """Spot checks of the rendering against the parser's own values: a `%%`-escaped help, a switch, a suppressed
    default, a required positional argument, a choice's default, an OffloadConfig default."""
    page = render()
    assert "| `--warmup-steps WARMUP_STEPS` | none | Number of steps for a linear warmup from 0 to `learning_rate`. " \
           "Default: 10% of --steps. |" in page
    assert "| `--offload {auto,device,host,disk}` | `disk` |" in page
    assert "| `adapter_dir` | required |" in page
    assert "| `--server {vllm,sglang,peft}` | `vllm` |" in page
    train = page[page.index("### `hf-moe-offload train`"):page.index("### `hf-moe-offload estimate`")]
    assert "| `--debug` | off |" in train  # the subcommand's --debug defaults to argparse.SUPPRESS: off unless given
    assert "| `--no-malloc-retain`" not in page  # help=SUPPRESS: hidden, as in --help
    rows = {name: (t, d) for name, t, d, _ in config_rows()}
    assert rows["`pin_fraction`"] == ("`float`", "`0.25`") and rows["`mode`"] == ("`str`", "`'auto'`")


def test_a_field_without_help_is_refused(monkeypatch):
    import hf_moe_offload.offload.config as config_module

    @dataclasses.dataclass
    class Bare:
        size: int = 1

    monkeypatch.setattr(config_module, "OffloadConfig", Bare)
    with pytest.raises(UserError, match=r"OffloadConfig.size has no help text: add field\(metadata="):
        config_rows()


def test_main_writes_the_page_atomically(tmp_path, capsys):
    out = tmp_path / "reference.md"
    out.write_text("old")
    assert main([str(out)]) == 0
    assert out.read_text() == render()
    assert sorted(os.listdir(tmp_path)) == ["reference.md"]  # no temporary file left
    assert main([str(tmp_path / "missing" / "reference.md")]) == 2
    err = capsys.readouterr().err
    assert "missing does not exist" in err and "create it, or give another path" in err


def test_write_text_atomic_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    out = tmp_path / "page.md"
    out.write_text("old")

    def fail(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        write_text_atomic(str(out), "new")
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["page.md"]
