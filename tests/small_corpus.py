"""A small text file for CLI runs whose assertions are about a flag's path, not about the data.

The default data (gensim's Wikipedia sample) costs every run a parse of the whole dump, a BPE trained on it and a
tokenization of all of it before the first step; a few KB of text exercise the same `--train-file` -> tokenizer ->
blocks -> Trainer path in a fraction of that.
"""

from __future__ import annotations

import torch

WORDS = ("the expert layer routes every token to two of its experts and the gate learns which experts fit each token "
         "while the offload engine streams the weights from disk").split()


def write_corpus(path, lines: int = 60, words: int = 40):
    """`lines` seeded lines of `words` words; with `--block-size 32` the 5% held out for evaluation make 3 blocks."""
    rng = torch.Generator().manual_seed(0)
    text = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (words,), generator=rng).tolist())
            for _ in range(lines)]
    path.write_text("\n".join(text) + "\n")
    return path
