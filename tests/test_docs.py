"""The README and the docs as a user runs them: the quick start's Python script runs as written on a tiny Hub-layout
checkpoint (made by the recipe the README names), every other Python block of README.md and docs/ runs on the CPU
(or, where the page marks it as needing a GPU, several processes or the network, compiles), and every
`hf-moe-offload` command line in README.md and docs/ parses against the real parser."""

from __future__ import annotations

import json
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
    from hf_moe_offload.cli.main import build_parser

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


ENV = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def quick_start_script() -> str:
    """The README's quick-start Python script (run by its own test, with its step and token counts lowered)."""
    (script,) = [b for b in blocks(os.path.join(ROOT, "README.md"), "python") if "load_offloaded_pretrained" in b]
    return script


@pytest.fixture(scope="module")
def tiny_release(tmp_path_factory):
    """A folder with `Qwen3-30B-A3B`, the tiny Hub-layout checkpoint `recipes/make_tiny_checkpoint.py` makes (the
    name the README and docs/ use for the real release), and `my_corpus.txt`, a small text to train on."""
    folder = tmp_path_factory.mktemp("release")
    subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "make_tiny_checkpoint.py"),
                    str(folder / "Qwen3-30B-A3B")], check=True, env=ENV, capture_output=True)
    words = "the history of an expert model that learns words from many sentences about art and science".split()
    (folder / "my_corpus.txt").write_text("\n".join(" ".join(words[(i + j) % len(words)] for j in range(24))
                                                    for i in range(64)))
    return folder


def workdir(release, path) -> None:
    """`path` as a reader's working directory: the tiny release linked in, the corpus copied."""
    path.mkdir(parents=True)
    (path / "Qwen3-30B-A3B").symlink_to(release / "Qwen3-30B-A3B", target_is_directory=True)
    (path / "my_corpus.txt").write_text((release / "my_corpus.txt").read_text())


@pytest.mark.slow
def test_the_quick_start_script_runs_on_a_tiny_checkpoint(tiny_release, tmp_path):
    """The README's Python script, run as written in a folder where `./Qwen3-30B-A3B` is the tiny checkpoint
    `recipes/make_tiny_checkpoint.py` makes and `my_corpus.txt` a small text: only its step and token counts are
    lowered. It trains, saves the adapter, exports it per expert and generates."""
    script = quick_start_script()
    assert "max_steps=500" in script and "max_new_tokens=20" in script
    script = script.replace("max_steps=500", "max_steps=2").replace("max_new_tokens=20", "max_new_tokens=4")
    workdir(tiny_release, tmp_path / "run")
    (tmp_path / "run" / "quick_start.py").write_text(script)
    res = subprocess.run([sys.executable, "quick_start.py"], cwd=tmp_path / "run", env=ENV, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trainable params" in res.stdout and res.stdout.strip().splitlines()[-1].startswith("The history of")
    assert (tmp_path / "run" / "out" / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "run" / "out" / "adapter-per-expert" / "adapter_model.safetensors").exists()


# A block is run unless the line before its fence says why it cannot be on this machine:
#     <!-- gpu-only -->                 needs a CUDA device
#     <!-- not-run: <reason> -->        e.g. several processes, the network
# Such blocks are compiled, so that a syntax error or a stray placeholder is still caught.
NOT_RUN = re.compile(r"^<!--\s*(gpu-only|not-run:\s*(\S.*?))\s*-->\s*$")

# Pages written by a generator (docs/reference.md, docs/hardware.md, docs/support.md: `python -m
# hf_moe_offload.<module> docs/<page>`) are read like the others: their blocks run, and a marker on one can only come
# from the generator, since their own tests regenerate them and compare.

# What the test changes in a block before running it, so that it runs in seconds in a temporary folder: the docs
# write the paths and step counts of a real run.
REPLACEMENTS = [
    (re.compile(r'"/nvme/'), '"nvme/'),  # folders on a fast local disk: in the page's folder
    (re.compile(r'"/tmp/experts"'), '"tmp-experts"'),  # the same, so that no two runs share a folder
    (re.compile(r"max_steps=\d+"), "max_steps=2"),  # a training run: two optimizer steps
]


def quantized_releases(folder) -> None:
    """`gpt-oss-20b` (MXFP4 experts) and `Qwen3-30B-A3B-FP8` (fine-grained FP8) as docs/families.md names them: tiny
    models of the families laid out as those releases are, by tests/test_prequantized_checkpoints.py's writer."""
    from moe_families import tiny_model
    from test_prequantized_checkpoints import RELEASES, write_release

    for family, name in [("gpt_oss", "gpt-oss-20b"), ("qwen3_moe", "Qwen3-30B-A3B-FP8")]:
        write_release(tiny_model(family, **RELEASES[family]).eval(), folder / name, decoded=False)


def main_job_output(folder) -> None:
    """`outputs/moe-gpt-small`, where the main job saves its MoE-GPT (docs/hub.md loads it): a tiny one."""
    from hf_moe_offload import MoEGPTConfig, MoEGPTForCausalLM

    MoEGPTForCausalLM(MoEGPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                   max_position_embeddings=64)).save_pretrained(folder / "outputs" / "moe-gpt-small")


# Files a page's blocks read beyond the tiny release and the corpus every page's folder has.
PAGE_FILES = {"docs/families.md": quantized_releases, "docs/hub.md": main_job_output}


def python_blocks(path: str) -> list[tuple[int, str, str | None]]:
    """Each ```python block of a page: (the line of its first source line, its source, why it is not run or None)."""
    lines = open(path, encoding="utf-8").read().splitlines(keepends=True)
    out, i = [], 0
    while i < len(lines):
        if lines[i].rstrip("\n") == "```python":
            marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
            j = i + 1
            while lines[j].rstrip("\n") != "```":
                j += 1
            reason = None if marker is None else (marker.group(2) or "needs a CUDA device")
            out.append((i + 1, "".join(lines[i + 1:j]), reason))
            i = j
        i += 1
    return out


def doc_pages_to_run() -> list[tuple[str, list[tuple[int, str]]]]:
    """(page, its blocks to run) for every page with Python blocks to run, the README's quick start left to its own
    test."""
    out = []
    for page in PAGES:
        run = [(line, source) for line, source, reason in python_blocks(page)
               if reason is None and source != quick_start_script()]
        if run:
            out.append((os.path.relpath(page, ROOT), run))
    return out


def test_blocks_not_run_say_why_and_compile():
    """Every block a page marks as not run here compiles; the markers are read as the run test reads them."""
    marked = []
    for page in PAGES:
        for line, source, reason in python_blocks(page):
            compile(source, f"{page}:{line}", "exec")
            if reason is not None:
                marked.append((os.path.relpath(page, ROOT), line, reason))
    assert marked, "no block is marked as not run: the marker pattern no longer matches the pages"
    assert all(len(reason) > 8 for _, _, reason in marked), marked


@pytest.mark.slow
def test_every_python_block_of_the_docs_runs(tiny_release, tmp_path):
    """Every Python block of README.md and docs/ not marked as needing a GPU, several processes or the network runs
    on the CPU: each page in a fresh process (forked from one that has imported torch, transformers, peft and the
    package), its blocks in order in one namespace, in a folder of its own where `./Qwen3-30B-A3B` is the tiny
    checkpoint and `my_corpus.txt` a small text. The blocks run as written but for REPLACEMENTS."""
    spec = []
    for page, run in doc_pages_to_run():
        cwd = tmp_path / page.replace("/", "_").removesuffix(".md")
        workdir(tiny_release, cwd)
        if page in PAGE_FILES:
            PAGE_FILES[page](cwd)
        for pattern, replacement in REPLACEMENTS:
            run = [(line, pattern.sub(replacement, source)) for line, source in run]
        spec.append({"page": page, "cwd": str(cwd), "blocks": run})
    assert len(spec) >= 12, [s["page"] for s in spec]
    (tmp_path / "pages.json").write_text(json.dumps(spec))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "scripts", "run_doc_pages.py"),
                          str(tmp_path / "pages.json")], env=ENV, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-2000:]
    ran = [line for line in res.stdout.splitlines() if line.startswith("PAGE ") and line.endswith(" ok")]
    assert len(ran) == len(spec), res.stdout[-8000:]
