"""The README and the docs as a user runs them: the quick start's Python script runs as written on a tiny Hub-layout
checkpoint (made by the recipe the README names), and every `hf-moe-offload` command line in README.md and docs/
parses against the real parser."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


def blocks(path: str, language: str) -> list[str]:
    text = open(path, encoding="utf-8").read()
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def cli_lines(path: str) -> list[str]:
    """Each `hf-moe-offload ...` command of the page's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("&&"):
                command = command.split(" #")[0].strip()
                if command.startswith("hf-moe-offload "):
                    out.append(command)
    return out


@pytest.mark.slow
def test_every_cli_line_of_the_docs_parses():
    from hf_moe_offload.cli import build_parser

    parser = build_parser()
    seen, failed = 0, []
    for page in PAGES:
        for command in cli_lines(page):
            if "[" in command or "<" in command:  # a synopsis with optional parts or placeholders, not a command
                continue
            seen += 1
            try:
                parser.parse_args(shlex.split(command)[1:])
            except SystemExit:
                failed.append(f"{os.path.relpath(page, ROOT)}: {command}")
    assert seen >= 15, seen
    assert not failed, "\n".join(failed)


@pytest.mark.slow
def test_the_quick_start_script_runs_on_a_tiny_checkpoint(tmp_path):
    """The README's Python script, run as written in a folder where `./Qwen3-30B-A3B` is the tiny checkpoint
    `recipes/make_tiny_checkpoint.py` makes and `my_corpus.txt` a small text: only its step and token counts are
    lowered. It trains, saves the adapter, exports it per expert and generates."""
    (script,) = [b for b in blocks(os.path.join(ROOT, "README.md"), "python") if "load_offloaded_pretrained" in b]
    assert "max_steps=500" in script and "max_new_tokens=20" in script
    script = script.replace("max_steps=500", "max_steps=2").replace("max_new_tokens=20", "max_new_tokens=4")
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "make_tiny_checkpoint.py"),
                    str(tmp_path / "Qwen3-30B-A3B")], check=True, env=env, capture_output=True)
    words = "the history of an expert model that learns words from many sentences about art and science".split()
    (tmp_path / "my_corpus.txt").write_text("\n".join(" ".join(words[(i + j) % len(words)] for j in range(24))
                                                      for i in range(64)))
    (tmp_path / "quick_start.py").write_text(script)
    res = subprocess.run([sys.executable, "quick_start.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trainable params" in res.stdout and res.stdout.strip().splitlines()[-1].startswith("The history of")
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "out" / "adapter-per-expert" / "adapter_model.safetensors").exists()
