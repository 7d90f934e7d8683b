"""Checkpoints in the layout transformers saves (the Hub layout) go through the offload stack, and what we save loads
in stock transformers.

- `load_offloaded_pretrained` reads a directory written by transformers' own `save_pretrained` (per-expert tensors
  for Qwen3-MoE and Mixtral, fused biased ones for gpt-oss; single file and sharded) expert by expert into the disk
  tier, through transformers' conversion rules for the family, and gives the stock model's logits.
- `hf-moe-offload train --short --model-path DIR --offload disk` on such a directory trains, and its output loads in a
  process that never imports hf_moe_offload, with no missing or unexpected key, holding the trained weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_moe_offload import OffloadConfig
from hf_moe_offload.errors import CheckpointError
from hf_moe_offload.offload.checkpoint import load_offloaded_pretrained

from moe_families import VOCAB, tiny_config, tiny_model
from small_corpus import write_corpus

FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]


def saved_keys(directory) -> list[str]:
    from safetensors import safe_open

    keys = []
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(directory, f), "pt") as s:
                keys += list(s.keys())
    return keys


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_hub_layout_checkpoint_streams_into_the_disk_tier(family, sharded, tmp_path):
    model = tiny_model(family)
    ckpt = tmp_path / "hub"
    model.save_pretrained(ckpt, max_shard_size="40KB" if sharded else "5GB")
    keys = saved_keys(ckpt)
    if family != "gpt_oss":  # transformers saves these families one tensor per expert and projection
        assert any(".experts.0." in k for k in keys), keys[:8]
    assert (len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")]) > 1) == sharded
    stock = AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager")
    ours = load_offloaded_pretrained(str(ckpt), OffloadConfig(mode="disk", offload_dir=str(tmp_path / "experts"),
                                                               host_cache_experts=2))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, stock(ids).logits, atol=1e-5, rtol=0)


def test_hub_layout_checkpoint_missing_an_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path / "hub")
    path = tmp_path / "hub" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks expert 4's tensors of model\.layers\.1\.mlp\.experts\.gate_up"):
        load_offloaded_pretrained(str(tmp_path / "hub"), OffloadConfig(mode="disk", offload_dir=str(tmp_path / "x")))


STOCK_LOAD = r"""
import json, sys
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

out, initial = sys.argv[1], sys.argv[2]
model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
before = AutoModelForCausalLM.from_pretrained(initial)
files = {}
for name in json.load(open(out + "/model.safetensors.index.json"))["weight_map"].items():
    files.setdefault(name[1], []).append(name[0])
state = model.state_dict()
file_diff = 0.0
for f, names in files.items():
    with safe_open(out + "/" + f, "pt") as s:
        for n in names:
            file_diff = max(file_diff, (s.get_tensor(n).float() - state[n].float()).abs().max().item())
initial_state = before.state_dict()
trained = {n: (t.float() - initial_state[n].float()).abs().max().item() for n, t in state.items() if "experts" in n}
print(json.dumps({"problems": {k: sorted(v) for k, v in info.items() if v}, "file_diff": file_diff,
                  "experts_moved": trained, "imported_hf_moe_offload": "hf_moe_offload" in sys.modules}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_train_cli_on_a_hub_checkpoint_and_load_the_output_without_this_package(family, tmp_path):
    """The training runs in this process (the CLI's `main`); the load runs in a fresh one that never imports
    hf_moe_offload. The text is a few KB (tests/small_corpus.py) in blocks of 32 tokens, and the checkpoint's
    tokenizer a byte-level BPE trained on it (a vocabulary of a few hundred, not GPT-2's 50257): the Hub layout, the
    family's loss path and the save are the same at any vocabulary, and 4 steps of 4 blocks with weight decay move
    every expert tensor."""
    from hf_moe_offload.cli.main import main
    from hf_moe_offload.data import gpt2_tokenizer, train_tokenizer

    corpus = write_corpus(tmp_path / "corpus.txt")
    tokenizer = train_tokenizer(gpt2_tokenizer(), corpus.read_text().splitlines(), 512)
    config = tiny_config(family)
    config.vocab_size, config.max_position_embeddings = len(tokenizer), 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "hub")
    tokenizer.save_pretrained(tmp_path / "hub")
    out = tmp_path / "out"
    assert main(["train", "--short", "--model-path", str(tmp_path / "hub"), "--offload", "disk", "--steps", "4",
                 "--block-size", "32", "--batch-size", "4", "--max-eval-blocks", "2", "--train-file", str(corpus),
                 "--output-dir", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert f"`{family}`" in card  # the card names the family
    assert "LM loss chunked, 1024 tokens at a time" in card  # the family's loss through ChunkedLossTrainer
    check = subprocess.run([sys.executable, "-c", STOCK_LOAD, str(out), str(tmp_path / "hub")], capture_output=True,
                           text=True, timeout=300, cwd=str(tmp_path))
    assert check.returncode == 0, check.stderr[-3000:]
    report = json.loads(check.stdout.strip().splitlines()[-1])
    assert not report["imported_hf_moe_offload"]
    assert report["problems"] == {}, report["problems"]  # no missing, unexpected or mismatched key
    assert report["file_diff"] == 0.0  # stock transformers holds exactly the saved (trained) tensors
    assert all(v > 0 for v in report["experts_moved"].values()), report["experts_moved"]  # every expert tensor trained
