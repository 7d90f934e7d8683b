"""docs/support.md is what tests/support_matrix.py generates from the tests' tables, and the generator reads those
tables as pytest does."""

from __future__ import annotations

import os

import pytest

import support_matrix
from support_matrix import (FEATURES, MOE_GPT, REGENERATE, Evidence, fixed, from_parametrize, parametrized,
                            simulated)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "support.md")


@pytest.mark.slow
def test_committed_support_matrix_is_the_generated_one():
    """Builds every family's tiny config (one forward each; cached within a session that already built them)."""
    with open(PAGE, encoding="utf-8") as f:
        committed = f.read()
    assert committed == support_matrix.render(), (
        f"docs/support.md is out of date with the tests' tables (or was generated with another transformers): "
        f"regenerate it with `{REGENERATE}`")


@pytest.mark.parametrize("a", [1, pytest.param(2, id="two")])
@pytest.mark.parametrize("tier,storage", [("host", "nf4"), pytest.param("disk", "int8", id="d")])
def _table(a, tier, storage):
    """A parametrized function like the tests' (not collected: no test_ prefix)."""


def test_parametrized_reads_joined_names_and_pytest_param():
    assert parametrized(__name__, "_table", "a") == [1, 2]
    assert parametrized(__name__, "_table", "tier") == ["host", "disk"]
    assert parametrized(__name__, "_table", "storage") == ["nf4", "int8"]
    with pytest.raises(LookupError, match="has no parametrize over 'family'"):
        parametrized(__name__, "_table", "family")


def test_evidence_that_outlives_its_test_is_refused():
    """A required parameter value the test no longer runs, a renamed test, or a test that no longer builds the family
    it is listed for: an error naming the test, not a silent cell."""
    with pytest.raises(LookupError, match="no longer runs tier=\\['device'\\]"):
        from_parametrize(__name__, "_table", "a", require={"tier": ("device",)})()
    assert from_parametrize(__name__, "_table", "a", require={"tier": ("host", "disk")})() == [1, 2]
    with pytest.raises(AttributeError):
        fixed(__name__, "test_that_does_not_exist", MOE_GPT, "x")()
    with pytest.raises(LookupError, match="no longer contains 'small_model\\('"):
        fixed("test_families", "test_qwen3_moe_micro_batch_pipelining_equals_stock", MOE_GPT, "small_model(")()
    assert fixed("test_families", "test_qwen3_moe_micro_batch_pipelining_equals_stock", "qwen3_moe",
                 'tiny_model("qwen3_moe")')() == ["qwen3_moe"]


def test_simulated_suites_select_as_pytest_does(monkeypatch):
    """The `-k` expression of a suite is evaluated on each test's name (pytest's own expression parser), a suite
    that lists files or node ids selects only those, and a `--deselect` prefix leaves its tests out."""
    import test_simulated_device

    monkeypatch.setattr(test_simulated_device, "SUITES", {
        "k": ["tests/test_families.py", "-k", "(qwen3_moe or gpt_oss) and not disk"],
        "node": ["tests/test_x.py::test_one[2]"],
        "deselect": ["tests/test_x.py", "--deselect", "tests/test_x.py::test_one[3]"],
    })
    name = "tests/test_families.py::test_family_offloaded_equals_stock[{}-{}]".format
    candidates = lambda: ["qwen3_moe", "gpt_oss", "mixtral"]  # noqa: E731
    assert simulated("k", candidates, lambda f: name(f, "host"))() == ["qwen3_moe", "gpt_oss"]
    assert simulated("k", candidates, lambda f: name(f, "disk"))() == []
    assert simulated("k", candidates, lambda f: f"tests/test_other.py::test_{f}")() == []
    assert simulated("node", lambda: [MOE_GPT], lambda f: "tests/test_x.py::test_one[2]")() == [MOE_GPT]
    assert simulated("node", lambda: [MOE_GPT], lambda f: "tests/test_x.py::test_one[3]")() == []
    assert simulated("deselect", lambda: [MOE_GPT], lambda f: "tests/test_x.py::test_one[2]")() == [MOE_GPT]
    assert simulated("deselect", lambda: [MOE_GPT], lambda f: "tests/test_x.py::test_one[3]")() == []


def test_every_evidence_names_a_test_that_exists():
    """Each CPU and simulated-device evidence names a test function of tests/ (what CI runs); the GPU ones name
    tests/test_cuda.py's functions or a benchmark."""
    for feature, evidence in FEATURES.items():
        for ev in evidence:
            assert isinstance(ev, Evidence) and ev.where in support_matrix.WHERE, (feature, ev.ref)
            if ev.ref.startswith("tests/"):
                path, _, test = ev.ref.partition("::")
                test = test.split("[")[0]
                with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                    assert f"def {test}(" in f.read(), (feature, ev.ref)
            else:
                assert ev.where == "GPU run" and ev.ref.startswith("benchmarks/"), (feature, ev.ref)
