"""The main job (`hf-moe-offload train`), its model card and push_to_hub up to the network boundary (issue 8)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from unittest import mock

import pytest
import torch

import hf_moe_offload  # noqa: F401  (registers moe_gpt with the Auto classes)

from small_corpus import write_corpus

# The runs below whose assertions are about a flag's path (LoRA, checkpointing, the push, a refusal) train on a few KB
# of text in blocks of 32 tokens: the flag's path is the same, without a parse and tokenization of the default data.
SMALL_RUN = ["--steps", "2", "--max-eval-blocks", "2", "--num-experts", "4", "--block-size", "32", "--batch-size", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One short run of the README's main-job command (the default model, data and vocabulary), in this process (the
    CLI's `main`; its stdout is the report). Batches of 4 sequences and 4 evaluation blocks instead of 8 and 16: the
    assertions (the loss falls over 12 steps, the figures, the card, the files) do not depend on the batch size."""
    from hf_moe_offload.cli.main import main

    out = tmp_path_factory.mktemp("main_job") / "run"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["train", "--short", "--batch-size", "4", "--max-eval-blocks", "4", "--output-dir", str(out)])
    assert code == 0, stdout.getvalue()[-3000:]
    return out, stdout.getvalue()


@pytest.mark.slow
def test_main_job_prints_figures_and_saves_a_loadable_model(run_dir):
    out, stdout = run_dir
    for line in ("train loss", "eval", "perplexity", "unigram baseline", "offload", "disk tier", "expert load", "saved"):
        assert line in stdout, stdout
    metrics = json.loads((out / "metrics.json").read_text())
    # issue 16: the unigram baseline of the same held-out blocks is recorded beside the model's perplexity
    assert metrics["metrics"]["unigram_perplexity"] > 1 and "unigram model" in metrics["note"]
    # the default trains a vocabulary of 8192 on the training text, and the model's head has that width
    assert metrics["model"]["vocab_size"] == 8192, metrics["model"]
    history = [h["loss"] for h in metrics["log_history"] if "loss" in h]
    assert history[-1] < history[0]  # the loss goes down
    # experts really lived on disk behind a cache smaller than the experts
    assert metrics["offload"]["mode"] == "disk" and metrics["offload"]["host_cache_fraction"] < 1, metrics["offload"]
    assert metrics["gradient_checkpointing"] is False  # --gradient-checkpointing auto without a GPU
    for name in ("README.md", "expert_load.png", "tokenizer.json", "model.safetensors.index.json"):
        assert (out / name).exists(), name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The history of", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size
    with open(out / "expert_load.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_model_card_contents(run_dir):
    out, _ = run_dir
    card = (out / "README.md").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    assert card.startswith("---\n") and "library_name: transformers" in card  # Hub metadata header
    for needle in ("experts", "active per token", "Expert offload", "disk", "Wikipedia", "perplexity", "unigram",
                   "expert_load.png", "trust_remote_code=True", "import hf_moe_offload"):
        assert needle in card, needle
    assert "{{" not in card  # every placeholder filled
    ppl = metrics["metrics"]["eval_perplexity"]
    line = next(l for l in card.splitlines() if "eval perplexity" in l)
    assert abs(float(line.strip("| ").split("|")[-1]) - ppl) <= 1e-3 * ppl, line  # the run's figure, not a stale one


@pytest.mark.slow
def test_push_to_hub_uploads_model_tokenizer_card_and_code(run_dir):
    """Mocks only the network calls (create_repo, upload_folder) and checks what would be uploaded."""
    from huggingface_hub import HfApi

    from hf_moe_offload.hub.upload import UPLOAD_IGNORE, push_to_hub

    out, _ = run_dir
    seen = {}

    def fake_upload(self, folder_path, repo_id, repo_type, commit_message, ignore_patterns):
        import fnmatch

        files = []
        for root, _, names in os.walk(folder_path):
            for n in names:
                rel = os.path.relpath(os.path.join(root, n), folder_path)
                if not any(fnmatch.fnmatch(rel, p) for p in ignore_patterns):
                    files.append(rel)
        seen.update(files=sorted(files), repo_id=repo_id, card=open(os.path.join(folder_path, "README.md")).read())

    with mock.patch.object(HfApi, "create_repo", return_value=mock.Mock(repo_id="me/moe-test")) as create, \
            mock.patch.object(HfApi, "upload_folder", fake_upload):
        url = push_to_hub(str(out), "me/moe-test", token="hf_fake")
    assert url.endswith("me/moe-test") and create.called
    files = set(seen["files"])
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "README.md", "expert_load.png",
            "modeling_moe_gpt.py", "configuration_moe_gpt.py"} <= files
    assert not any(f.startswith("expert_store") for f in files), "the offload store must not be uploaded"
    assert "me/moe-test" in seen["card"]  # snippets load from the Hub repo
    assert UPLOAD_IGNORE


def test_push_refuses_an_incomplete_folder(tmp_path):
    from hf_moe_offload.hub.upload import push_to_hub

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="not ready to push"):
        push_to_hub(str(tmp_path), "me/x", token="hf_fake")


@pytest.mark.slow
def test_push_to_hub_flag_of_the_cli(tmp_path, capsys, corpus):
    """`hf-moe-offload train --push-to-hub --hub-model-id ...` pushes the finished run (upload mocked at the
    network boundary) and prints the URL; the card names the repo."""
    from huggingface_hub import HfApi

    from hf_moe_offload.cli.main import main

    uploaded = {}

    def fake_upload(self, folder_path, repo_id, repo_type, commit_message, ignore_patterns):
        uploaded.update(folder=folder_path, repo_id=repo_id, files=sorted(os.listdir(folder_path)))

    out = tmp_path / "run"
    with mock.patch.object(HfApi, "create_repo", return_value=mock.Mock(repo_id="me/tiny-moe")), \
            mock.patch.object(HfApi, "upload_folder", fake_upload):
        assert main(["train", "--short", *SMALL_RUN, "--train-file", str(corpus), "--output-dir", str(out),
                     "--push-to-hub", "--hub-model-id", "me/tiny-moe"]) == 0
    assert uploaded["repo_id"] == "me/tiny-moe" and os.path.samefile(uploaded["folder"], out)
    assert {"README.md", "config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(uploaded["files"])
    assert "pushed" in capsys.readouterr().out
    assert "me/tiny-moe" in (out / "README.md").read_text()
    assert json.loads((out / "metrics.json").read_text())["hub_model_id"] == "me/tiny-moe"


def test_main_job_with_lora_on_the_streamed_experts(tmp_path, corpus):
    """Issue 38, item 4: `hf-moe-offload train --method lora --lora-targets experts,attention` trains adapters on
    every expert matrix while the frozen experts stay on the disk tier; it saves the peft adapter (its config names
    the expert tensors) and the merged model, which transformers loads as a plain model, and the card says so."""
    from hf_moe_offload.cli.main import main

    out = tmp_path / "run"
    assert main(["train", "--short", *SMALL_RUN, "--train-file", str(corpus), "--method", "lora",
                 "--lora-targets", "experts,attention", "--expert-storage", "nf4", "--output-dir", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["training"]["method"] == "lora" and "(every expert, streamed)" in metrics["training"]["lora"]
    assert metrics["training"]["expert_storage"] == "nf4"
    assert metrics["offload"]["mode"] == "disk" and metrics["offload"]["expert_state_rows"].startswith("nf4 weights")
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_parameters"]) == {"experts.fc1_weight", "experts.fc2_weight"}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in model.named_parameters())
    card = (out / "README.md").read_text()
    assert "| experts | frozen, stored as nf4, never stepped |" in card and "expert-wise CPU optimizer" not in card


def test_main_job_refuses_quantized_storage_of_trained_experts(tmp_path, capsys, corpus):
    from hf_moe_offload.cli.main import main

    assert main(["train", "--short", *SMALL_RUN, "--train-file", str(corpus), "--expert-storage", "int8",
                 "--output-dir", str(tmp_path / "run")]) != 0
    assert "--expert-storage int8 keeps frozen experts quantized" in capsys.readouterr().err


def test_lm_nll_per_sequence_equals_the_batched_cross_entropy():
    """The evaluation's per-sequence NLL (taken one sequence at a time, to bound memory) equals the batched
    cross-entropy with ignored labels, and the perplexity follows from it (fp32, rtol 1e-6)."""
    import math

    import numpy as np
    import torch.nn.functional as F

    from hf_moe_offload.jobs import lm_nll_per_sequence, perplexity_metrics

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 9, 50, generator=g)
    labels = torch.randint(0, 50, (3, 9), generator=g)
    labels[1, 3:6] = -100
    out = lm_nll_per_sequence(logits, labels)
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100,
                          reduction="none").view(3, 8)
    mask = labels[:, 1:] != -100
    torch.testing.assert_close(out[:, 0], (nll * mask).sum(dim=1), rtol=1e-6, atol=1e-5)
    assert out[:, 1].tolist() == [8.0, 5.0, 8.0]
    metrics = perplexity_metrics(type("P", (), {"predictions": np.asarray(out)})())
    assert metrics["perplexity"] == pytest.approx(math.exp(float(nll[mask].mean())), rel=1e-6)


def test_main_job_with_activation_checkpointing_on_the_disk_tier(tmp_path, corpus):
    """`--gradient-checkpointing on`: the Trainer recomputes every decoder layer in the backward while the experts
    stream from the disk tier, and the run records the choice (`auto`, the default, on a machine without a GPU leaves
    it off: test_main_job_prints_figures_and_saves_a_loadable_model)."""
    from hf_moe_offload.cli.main import main

    out = tmp_path / "run"
    assert main(["train", "--short", *SMALL_RUN, "--train-file", str(corpus), "--gradient-checkpointing", "on",
                 "--output-dir", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["gradient_checkpointing"] is True and math.isfinite(metrics["metrics"]["eval_loss"])
    # the card of a full run says what stepped the experts, that checkpointing was on, and the MoE layers
    card = (out / "README.md").read_text()
    assert metrics["training"]["experts"]["stepped_by"] == "expert-wise CPU optimizer"
    assert "| experts | trained, stepped by the expert-wise CPU optimizer on the host" in card
    assert "| trained | every parameter: the experts by the expert-wise CPU optimizer" in card
    assert "| frozen | nothing |" in card and "| activation checkpointing | on: " in card
    from hf_moe_offload.models.moe_gpt import MoEGPTConfig

    layers = MoEGPTConfig.from_pretrained(out).moe_layer_indices
    assert metrics["model"]["moe_layer_indices"] == layers
    assert f"| MoE layers | {len(layers)} (layers {', '.join(map(str, layers))}) |" in card


def test_auto_checkpointing_turns_on_where_the_batch_would_not_fit_the_device_without_it():
    """`needs_checkpointing` (the jobs' `--gradient-checkpointing auto` on a GPU): off where the batch fits, on where
    the estimate's device figure without checkpointing exceeds 90% of the budget."""
    from hf_moe_offload.planning.estimate import Workload, estimate, needs_checkpointing
    from hf_moe_offload.models.moe_gpt import MoEGPTConfig

    config = MoEGPTConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_experts=8,
                          max_position_embeddings=256, intermediate_size=256)
    w = Workload(method="full", batch_size=8, seq_len=256, device="cuda")
    need = estimate(config, w, device_budget=1 << 40, host_budget=1 << 40).tiers["host"].device_bytes
    assert not needs_checkpointing(config, w, "host", int(need / 0.8))
    assert needs_checkpointing(config, w, "host", int(need / 0.95))
