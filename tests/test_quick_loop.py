"""The edit loop's table (tests/conftest.py QUICK) names tests that exist: CI runs the whole suite, not `-m quick`,
so a renamed test would otherwise leave the loop unnoticed until someone runs it."""

from __future__ import annotations

import os

import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_every_quick_entry_names_a_test_of_its_file():
    for filename, names in conftest.QUICK.items():
        with open(os.path.join(TESTS, filename), encoding="utf-8") as f:
            source = f.read()
        for name in names:
            assert f"def {name.split('[')[0]}(" in source, (filename, name)
