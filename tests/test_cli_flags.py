"""The jobs' offload flags are `OffloadConfig`'s fields (hf_moe_offload.flags): every field is a flag of
`hf-moe-offload train` or says why not, each flag's default is the field's (in the flag's unit), and the parsed flags
come back as the config. Training flags that map onto a `TrainingArguments` field say what transformers says."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from hf_moe_offload import OffloadConfig
from hf_moe_offload.cli import build_parser
from hf_moe_offload.errors import UserError
from hf_moe_offload.flags import add_dataclass_arguments, dataclass_values, flag_fields, flag_value, option
from hf_moe_offload.jobs import offload_config
from hf_moe_offload.reference import _subcommands
from hf_moe_offload.train import DEFAULT_OUTPUT_DIR

# What `hf-moe-offload train` sets differently from OffloadConfig's defaults: its tier.
TRAIN_DEFAULTS = {"mode": "disk"}


def _train_parser() -> argparse.ArgumentParser:
    return next(sub for name, _, sub in _subcommands(build_parser()) if name == "train")


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def test_every_field_is_a_flag_of_train_or_says_why_not():
    parser = _train_parser()
    text = parser.format_help()
    flags = {f.name for f, _ in flag_fields(OffloadConfig)}
    for f in dataclasses.fields(OffloadConfig):
        if f.name in flags:
            assert f"{option(f)} " in text, f"{option(f)} ({f.name}) is not in `hf-moe-offload train --help`"
        else:
            reason = f.metadata.get("no_flag")
            assert isinstance(reason, str) and len(reason) > 10, f"OffloadConfig.{f.name}: no flag and no reason"
    assert flags >= {"mode", "offload_dir", "host_cache_bytes", "prefetch_depth", "pin_fraction", "expert_storage"}
    assert {f.name for f in dataclasses.fields(OffloadConfig)} - flags == {
        "compute_dtype", "train_experts", "inference", "device"}


def test_the_flags_defaults_are_the_fields():
    """Change-detection: a default changed on the field changes the flag's; only the job's own tier differs."""
    parser = _train_parser()
    for f, kind in flag_fields(OffloadConfig):
        expected = flag_value(f, kind, TRAIN_DEFAULTS.get(f.name, f.default))
        assert _action(parser, option(f)).default == expected, f.name
    assert _action(parser, "--offload").default == "disk" and OffloadConfig().mode == "auto"


def test_existing_flag_names_units_and_groups():
    parser = _train_parser()
    groups = {a.dest: g.title for g in parser._action_groups for a in g._group_actions}
    for flag in ("--offload", "--offload-dir", "--host-cache-mb", "--host-cache-experts", "--prefetch-depth",
                 "--pin-fraction", "--device-budget-mb", "--host-budget-mb"):
        assert groups[_action(parser, flag).dest].startswith("expert offload"), flag
    assert groups["expert_storage"] == "fine-tuning method"
    assert _action(parser, "--offload").choices == ("auto", "device", "host", "disk")
    assert _action(parser, "--keep-activations").choices == ("auto", "on", "off")  # as --gradient-checkpointing
    with pytest.raises(SystemExit):  # one host cache bound at a time
        parser.parse_args(["--host-cache-mb", "64", "--host-cache-experts", "4"])


def test_parsed_flags_are_the_config(tmp_path):
    parser = _train_parser()
    args = parser.parse_args(["--output-dir", str(tmp_path), "--host-cache-mb", "1.5", "--device-budget-mb", "512",
                              "--prefetch-depth", "3", "--io-threads", "4", "--pin-fraction", "0.5",
                              "--keep-activations", "off", "--mmap", "on", "--stage-experts", "2",
                              "--precision", "bf16"])
    config = offload_config(args)
    assert config.mode == "disk" and config.offload_dir == str(tmp_path / "expert_store")
    assert config.host_cache_bytes == int(1.5 * 2**20) and config.device_budget_bytes == 512 * 2**20
    assert (config.prefetch_depth, config.io_threads, config.pin_fraction, config.stage_experts) == (3, 4, 0.5, 2)
    assert config.keep_activations is False and config.mmap_weights is True and config.pregate is None
    assert config.compute_dtype == torch.bfloat16 and config.train_experts is True  # the non-flag fields' setters
    defaults = offload_config(parser.parse_args([]))
    untouched = {f.name for f in dataclasses.fields(OffloadConfig)} - {"mode", "offload_dir"}
    assert {n: getattr(defaults, n) for n in untouched} == {n: getattr(OffloadConfig(), n) for n in untouched}
    assert defaults.offload_dir == f"{DEFAULT_OUTPUT_DIR}/expert_store"


def test_an_invalid_value_names_the_flag():
    parser = _train_parser()
    with pytest.raises(UserError, match=r"--prefetch-depth \(prefetch_depth\) must be >= 1"):
        offload_config(parser.parse_args(["--prefetch-depth", "0"]))
    with pytest.raises(UserError, match=r"--host-cache-mb \(host_cache_bytes\) must be positive"):
        offload_config(parser.parse_args(["--host-cache-mb", "0"]))


def test_training_flags_take_transformers_help():
    from transformers import TrainingArguments

    theirs = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainingArguments)}
    parser = _train_parser()
    assert _action(parser, "--weight-decay").help == theirs["weight_decay"]
    assert _action(parser, "--max-grad-norm").help.startswith(theirs["max_grad_norm"])
    assert theirs["warmup_steps"].startswith(_action(parser, "--warmup-steps").help.split(" Default:")[0])


def test_the_generator_on_a_dataclass_of_its_own():
    @dataclasses.dataclass
    class Settings:
        size_bytes: int | None = field_(None, help="a size", flag="--size-mb", unit="MiB")
        switch: bool | None = field_(None, help="a switch")
        plain: bool = field_(True, help="a plain switch")
        name: str = field_("a", help="a name", choices=("a", "b"), group="other")
        hidden: int = field_(0, help="set elsewhere", no_flag="another flag sets it")

    p = argparse.ArgumentParser()
    add_dataclass_arguments(p.add_argument_group("settings"), Settings)
    add_dataclass_arguments(p.add_argument_group("other"), Settings, only="other", defaults={"name": "b"})
    args = p.parse_args(["--size-mb", "2", "--switch", "on"])
    assert dataclass_values(Settings, args) == {"size_bytes": 2 * 2**20, "switch": True, "plain": True, "name": "b"}
    assert _action(p, "--plain").choices == ("on", "off") and _action(p, "--switch").choices == ("auto", "on", "off")
    assert not hasattr(args, "hidden")
    assert "(the flag takes MiB)" in _action(p, "--size-mb").help

    @dataclasses.dataclass
    class Bare:
        size: int = 1

    with pytest.raises(TypeError, match=r"Bare.size: a flag needs metadata\['help'\]"):
        add_dataclass_arguments(argparse.ArgumentParser(), Bare)


def field_(default, **metadata):
    return dataclasses.field(default=default, metadata=metadata)
