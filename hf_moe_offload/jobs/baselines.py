"""The figures a trained model has to beat, computed on the same held-out data as the model's own.

- Language modelling: the perplexity of an add-one (Laplace) smoothed unigram model whose counts come from the
  training tokens, scored on exactly the positions the LM is scored on (every token of each evaluation block but the
  first, as the causal-LM loss shifts labels by one).
- Classification: the accuracy of always answering the training set's most frequent class, and a 95% Wilson score
  interval for the model's measured accuracy (a finite evaluation set makes every accuracy an estimate).

A model whose perplexity is not below the unigram baseline has learned no more than token frequencies; a classifier
whose interval does not lie above the majority accuracy has not been shown to beat a constant answer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

# Two-sided 95% normal quantile, for the Wilson interval.
Z_95 = 1.959963984540054


def unigram_counts(token_blocks: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Occurrences of each token id in `token_blocks` (e.g. the training set's `input_ids`), shape (vocab_size,)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for block in token_blocks:
        ids = np.asarray(block, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token id out of range [0, {vocab_size}) in the training blocks")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def unigram_perplexity(counts: np.ndarray, eval_blocks: Iterable[Sequence[int]]) -> float:
    """Perplexity of the add-one smoothed unigram model `p(t) = (c_t + 1) / (N + V)` on the predicted positions of
    `eval_blocks` (each block's tokens after its first, as the LM loss scores them)."""
    counts = np.asarray(counts, dtype=np.float64)
    log_p = np.log(counts + 1.0) - math.log(counts.sum() + counts.size)
    nll, n = 0.0, 0
    for block in eval_blocks:
        targets = np.asarray(block, dtype=np.int64)[1:]
        nll -= float(log_p[targets].sum())
        n += targets.size
    if n == 0:
        raise ValueError("no evaluation tokens to score (blocks of one token or none)")
    return math.exp(nll / n)


def majority_baseline(train_labels: Iterable[int], eval_labels: Sequence[int]) -> tuple[int, float]:
    """(the training set's most frequent label, the accuracy of always predicting it on `eval_labels`).

    Ties go to the smallest label, so the figure does not depend on the order of the data.
    """
    counts = Counter(int(y) for y in train_labels)
    if not counts:
        raise ValueError("no training labels")
    if len(eval_labels) == 0:
        raise ValueError("no evaluation labels")
    label = min(counts, key=lambda y: (-counts[y], y))
    return label, sum(int(y) == label for y in eval_labels) / len(eval_labels)


def accuracy_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval (95% by default) for an accuracy of `correct` / `total`."""
    if total <= 0 or not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total and total > 0, got {correct} / {total}")
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z / (1 + z * z / total) * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    return max(0.0, centre - half), min(1.0, centre + half)


def versus_baseline(low: float, high: float, baseline: float) -> str:
    """Where an accuracy's interval [low, high] lies against a baseline accuracy: "above baseline" or "below
    baseline" when it excludes it, else "not distinguishable from baseline"."""
    if low > baseline:
        return "above baseline"
    if high < baseline:
        return "below baseline"
    return "not distinguishable from baseline"


__all__ = ["unigram_counts", "unigram_perplexity", "majority_baseline", "accuracy_interval", "versus_baseline"]
