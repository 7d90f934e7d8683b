"""The CLI and `import hf_moe_offload` print nothing a user did not ask for: bitsandbytes' import-time warning about
the optional `kernels` package and transformers' FutureWarning for peft's read of `is_gradient_checkpointing` are
dropped where they are emitted (hf_moe_offload/quiet.py), and nothing else is."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from hf_moe_offload.quiet import BITSANDBYTES_CPU_OPS_LOGGER, MISSING_CPU_KERNEL_MESSAGE, peft_wrapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_help_prints_the_help_only(monkeypatch):
    """`python -m hf_moe_offload.cli.main --help` (which runs `import hf_moe_offload` first, then imports every
    subcommand's module to build the parser) prints nothing on stderr and exactly the parser's help on stdout."""
    from hf_moe_offload.cli.main import build_parser

    monkeypatch.setenv("COLUMNS", "100")  # argparse's width, here and in the child
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # Python's default warning filters
    run = subprocess.run([sys.executable, "-m", "hf_moe_offload.cli.main", "--help"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout == build_parser().format_help(), run.stdout[:500]


def test_the_filter_drops_only_the_missing_kernel_warning():
    """What bitsandbytes logs on that logger when `kernels` is missing is dropped; its other records pass. The message
    and logger are bitsandbytes' own (read from the installed source), so the filter tracks the real emitter."""
    import inspect

    import bitsandbytes.backends.cpu.ops as cpu_ops

    source = inspect.getsource(cpu_ops)
    assert MISSING_CPU_KERNEL_MESSAGE in source and cpu_ops.logger.name == BITSANDBYTES_CPU_OPS_LOGGER

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    target = logging.getLogger(BITSANDBYTES_CPU_OPS_LOGGER)
    handler = Collect()
    target.addHandler(handler)
    try:
        target.warning(MISSING_CPU_KERNEL_MESSAGE + ": %s. Please make sure you already `pip install kernels`",
                       "No module named 'kernels'")
        target.warning("another bitsandbytes warning")
    finally:
        target.removeHandler(handler)
    assert seen == ["another bitsandbytes warning"]


def test_peft_wrapping_ignores_only_the_deprecated_checkpointing_read():
    """Inside `peft_wrapping()`, `get_peft_model` raises no FutureWarning about `is_gradient_checkpointing`; any other
    warning still shows."""
    from peft import LoraConfig, get_peft_model

    from moe_families import tiny_model

    model = tiny_model("qwen3_moe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with peft_wrapping():
            get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
            warnings.warn("a warning of the caller's own", FutureWarning)
    messages = [str(w.message) for w in caught]
    assert not any("is_gradient_checkpointing" in m for m in messages), messages
    assert "a warning of the caller's own" in messages
