"""The tree as the docs describe it: docs/development.md's map names every module of the package and nothing else, the
README's architecture table names only files that exist, and no module is over 500 lines."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_moe_offload"
MAX_LINES = 500


def _modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def _named(text: str) -> set[str]:
    """The files a section's tables name (the prose around them may name tests and `__init__.py`)."""
    rows = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    return set(re.findall(r"`([\w/]+\.py)`", rows))


def _section(path: Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else len(text)]


def test_the_development_map_names_every_module_and_only_those():
    named = _named(_section(ROOT / "docs" / "development.md", "## The package: a map"))
    modules = _modules()
    assert not modules - named, f"modules the map does not name: {sorted(modules - named)}"
    assert not named - modules, f"the map names files that are not there: {sorted(named - modules)}"


def test_the_readme_architecture_names_files_that_exist():
    named = _named(_section(ROOT / "README.md", "## Architecture"))
    assert len(named) > 30
    assert not named - _modules(), f"README.md names files that are not there: {sorted(named - _modules())}"


def test_no_module_is_over_500_lines():
    long = {m: n for m in _modules() if (n := len((PACKAGE / m).read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
