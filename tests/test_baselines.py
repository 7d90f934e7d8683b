"""Baselines every figure is reported against, and the offline classification data (issue 16)."""

from __future__ import annotations

import pytest

from hf_moe_offload.jobs.baselines import (
    accuracy_interval,
    majority_baseline,
    unigram_counts,
    unigram_perplexity,
    versus_baseline,
)


def test_unigram_counts_and_perplexity_exact():
    counts = unigram_counts([[1, 1, 2], [3]], vocab_size=5)
    assert counts.tolist() == [0, 2, 1, 1, 0]
    # p(t) = (c_t + 1) / (4 + 5); scored tokens are each block's after its first: 1, 2 and 4.
    # p = 3/9, 2/9, 1/9 -> perplexity = (9^3 / (3 * 2 * 1)) ** (1/3)
    ppl = unigram_perplexity(counts, [[0, 1, 2], [4, 4]])
    assert ppl == pytest.approx((729 / 6) ** (1 / 3), rel=1e-12)
    # a uniform count gives perplexity = vocabulary size, whatever the text
    assert unigram_perplexity(unigram_counts([[0, 1, 2, 3]], 4), [[3, 2, 1, 0, 0]]) == pytest.approx(4.0, rel=1e-12)


def test_unigram_refuses_bad_input():
    with pytest.raises(ValueError, match="out of range"):
        unigram_counts([[0, 7]], vocab_size=5)
    with pytest.raises(ValueError, match="no evaluation tokens"):
        unigram_perplexity(unigram_counts([[0, 1]], 2), [[1], []])


def test_majority_baseline_exact():
    assert majority_baseline([0, 1, 1, 2, 1], [1, 0, 0, 1]) == (1, 0.5)
    assert majority_baseline([2, 0, 2, 0], [0, 0, 2]) == (0, pytest.approx(2 / 3))  # a tie goes to the smaller label
    with pytest.raises(ValueError):
        majority_baseline([], [0])


def test_wilson_interval_known_values():
    # Textbook Wilson score intervals (z = 1.96).
    assert accuracy_interval(50, 100) == pytest.approx((0.40383, 0.59617), abs=1e-5)
    low, high = accuracy_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.27753, abs=1e-5)
    low, high = accuracy_interval(850, 1000)
    assert low < 0.85 < high and high - low == pytest.approx(0.04426, abs=1e-4)
    with pytest.raises(ValueError):
        accuracy_interval(5, 4)
    assert versus_baseline(0.55, 0.61, 0.42) == "above baseline"
    assert versus_baseline(0.30, 0.40, 0.42) == "below baseline"
    assert versus_baseline(0.40, 0.46, 0.42) == "not distinguishable from baseline"


def test_offline_tweet_dataset_loads_and_splits_deterministically():
    from hf_moe_offload.data import TWEET_LABELS, load_classification_dataset

    first = load_classification_dataset(seed=0)
    again = load_classification_dataset(seed=0)
    other = load_classification_dataset(seed=1)
    assert len(first["train"]) >= 10_000 and len(first["validation"]) >= 1000
    assert first["validation"]["sentence"] == again["validation"]["sentence"]
    assert first["train"]["label"] == again["train"]["label"]
    assert first["validation"]["sentence"] != other["validation"]["sentence"]
    # no tweet on both sides of the split (duplicates were removed), every label valid
    assert not set(first["train"]["sentence"]) & set(first["validation"]["sentence"])
    assert set(first["train"]["label"]) == set(range(len(TWEET_LABELS)))
    # the majority class is a real baseline to beat, not a near-certain answer
    _, majority = majority_baseline(first["train"]["label"], first["validation"]["label"])
    assert 1 / len(TWEET_LABELS) < majority < 0.5
