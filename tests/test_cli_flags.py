"""The jobs' offload flags are `OffloadConfig`'s fields (hf_moe_offload.cli.flags): every field is a flag of
`hf-moe-offload train` or says why not, each flag's default is the field's (in the flag's unit), and the parsed flags
come back as the config. `generate` and `estimate` take the fields they name (`names=`) as the same generated flags.
Training flags that map onto a `TrainingArguments` field say what transformers says."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from hf_moe_offload import OffloadConfig
from hf_moe_offload.cli.main import build_parser
from hf_moe_offload.errors import UserError
from hf_moe_offload.cli.flags import add_dataclass_arguments, dataclass_values, flag_fields, flag_value, option
from hf_moe_offload.jobs import offload_config
from hf_moe_offload.cli.reference import _subcommands
from hf_moe_offload.cli.train import DEFAULT_OUTPUT_DIR

# What `hf-moe-offload train` sets differently from OffloadConfig's defaults: its tier.
TRAIN_DEFAULTS = {"mode": "disk"}


def _subparser(command: str) -> argparse.ArgumentParser:
    return next(sub for name, _, sub in _subcommands(build_parser()) if name == command)


def _train_parser() -> argparse.ArgumentParser:
    return _subparser("train")


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


@pytest.mark.parametrize("command", ["generate", "estimate"])
def test_generate_and_estimate_take_the_generated_offload_flags(command):
    """Every flag of generate / estimate that names an OffloadConfig field (its option string or its destination) is
    the field's generated flag, as train has it: help, type, unit, choices; and the default is the field's."""
    from hf_moe_offload.cli import generate
    from hf_moe_offload.planning import estimate

    names = {"generate": generate.FLAG_FIELDS, "estimate": estimate.FLAG_FIELDS}[command]
    parser, train = _subparser(command), _train_parser()
    fields = {f.name: (f, kind) for f, kind in flag_fields(OffloadConfig)}
    by_flag = {option(f): name for name, (f, _) in fields.items()}
    named = {by_flag.get(flag) or (a.dest if a.dest in fields else None)
             for a in parser._actions for flag in a.option_strings} - {None}
    # generate's --offload (disk|host|none) is its own: `none` is no OffloadConfig.mode
    assert named - {"mode"} == set(names), command
    for name in names:
        f, kind = fields[name]
        ours, theirs = _action(parser, option(f)), _action(train, option(f))
        assert ours.help.startswith(f.metadata["help"].replace("%", "%%")), name
        assert ours.help.split("; ")[0] == theirs.help.split("; ")[0], name
        assert (ours.type, ours.choices, ours.metavar, ours.dest) == (theirs.type, theirs.choices, theirs.metavar,
                                                                       theirs.dest), name
        assert ours.default == flag_value(f, kind, f.default), name
    assert not any(flag in parser.format_help() for flag in ("--device-cache-gb", "GiB"))


def test_generate_device_cache_flag_is_train_s_mib_and_builds_the_config():
    from hf_moe_offload.cli.generate import inference_config, offload_arguments

    parser = build_parser()
    args = parser.parse_args(["generate", "--device-cache-mb", "64", "--pregate", "off", "--mmap", "on",
                              "--host-cache-experts", "3"])
    config = inference_config(**offload_arguments(args, "/tmp/experts"))
    assert config.device_cache_bytes == 64 * 2**20
    assert (config.mode, config.offload_dir, config.host_cache_experts) == ("disk", "/tmp/experts", 3)
    assert config.pregate is False and config.mmap_weights is True and config.train_experts is False
    assert _action(_subparser("generate"), "--device-cache-mb").metavar == "MIB"
    defaults = inference_config(**offload_arguments(parser.parse_args(["generate", "--offload", "host"])))
    assert (defaults.mode, defaults.device_cache_bytes, defaults.pregate, defaults.mmap_weights) == (
        "host", None, None, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--device-cache-gb", "1"])


def test_estimate_reads_its_offload_flags_back_into_the_workload(monkeypatch):
    from hf_moe_offload.planning import estimate

    class Seen(Exception):
        pass

    def seen(config, workload, **budgets):
        raise Seen(workload)

    monkeypatch.setattr("hf_moe_offload.planning.model_shapes.load_config", lambda model: (None, model))
    monkeypatch.setattr(estimate, "estimate", seen)
    args = build_parser().parse_args(["estimate", "m", "--method", "lora", "--expert-storage", "nf4",
                                      "--host-cache-experts", "5", "--pin-fraction", "0.5", "--device", "cpu"])
    with pytest.raises(Seen) as raised:
        args.func(args)
    w = raised.value.args[0]
    assert (w.expert_storage, w.host_cache_experts, w.pin_fraction, w.device) == ("nf4", 5, 0.5, "cpu")


def test_names_picks_fields_in_order_whatever_their_group():
    p = argparse.ArgumentParser()
    add_dataclass_arguments(p, OffloadConfig, names=("pin_fraction", "expert_storage"), defaults={"pin_fraction": 0.5})
    assert [a.dest for a in p._actions[1:]] == ["pin_fraction", "expert_storage"]  # expert_storage: group "method"
    args = p.parse_args([])
    assert dataclass_values(OffloadConfig, args, names=("pin_fraction", "expert_storage")) == {
        "pin_fraction": 0.5, "expert_storage": "auto"}
    with pytest.raises(TypeError, match="no flag"):
        add_dataclass_arguments(argparse.ArgumentParser(), OffloadConfig, names=("device",))
    with pytest.raises(TypeError, match="no field 'nope'"):
        add_dataclass_arguments(argparse.ArgumentParser(), OffloadConfig, names=("nope",))
    with pytest.raises(TypeError, match="not both"):
        add_dataclass_arguments(argparse.ArgumentParser(), OffloadConfig, only="method", names=("pin_fraction",))
    with pytest.raises(TypeError, match="no --mmap"):
        dataclass_values(OffloadConfig, args, names=("mmap_weights",))


def field_(default, **metadata):
    return dataclasses.field(default=default, metadata=metadata)
