"""What the README and docs/ point at exists: every repository path they name (a module, a bench, a config, a
results file or figure) and every test they cite as the evidence of a claim (`file.py::test_name`, or
`::test_name` after a file named earlier in the same table row or paragraph; `*` globs, `[...]` parameters).
A renamed test or moved file otherwise leaves docs/reliability.md citing evidence that no longer exists."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.$])((?:src/itmatch|bench|scripts|docs|configs|tests)/[\w./-]+"
                  r"\.(?:py|md|yaml|csv|png|json))")
PLACEHOLDER = re.compile(r"/[A-Z]+\.\w+$")  # docs/results/X.csv
TEST_FILE = re.compile(r"`((?:tests/)?[\w/]*test_\w+\.py)(?:::([\w*]+)(?:\[[^\]]*\])?)?`")
TEST_NAME = re.compile(r"`::([\w*]+)(?:\[[^\]]*\])?`")


def _blocks(page: Path) -> list[tuple[int, str]]:
    """A page's paragraphs and table rows, each with its first line: the scope of a bare `::test_name`."""
    blocks, current, start = [], [], 0
    for number, line in enumerate([*page.read_text(encoding="utf-8").splitlines(), ""], 1):
        if current and (not line.strip() or line.startswith("|")):
            blocks.append((start, " ".join(current)))
            current = []
        if line.strip():
            start = start if current else number
            current.append(line)
    return blocks


def _test_names(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")}


def _citations() -> list[tuple[str, str, str | None]]:
    """(page:line, test file relative to tests/, test name or None) for every test the pages cite."""
    found = []
    for page in PAGES:
        for line, text in _blocks(page):
            where, last = f"{page.relative_to(ROOT)}:{line}", None
            for match in re.finditer(f"{TEST_FILE.pattern}|{TEST_NAME.pattern}", text):
                named_file, named_test, bare_test = match.groups()
                last = named_file.removeprefix("tests/") if named_file else last
                found.append((where, last or "", named_test or bare_test))
    return found


CITATIONS = _citations()


def test_the_pages_cite_tests_and_name_paths():
    """(the reading itself: a change in the pages' form must not leave the tests below checking nothing)"""
    assert len(CITATIONS) > 100 and sum(name is not None for *_, name in CITATIONS) > 70


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_a_page_names_exists(page: Path):
    text = page.read_text(encoding="utf-8")
    missing = sorted({m.group(1) for m in PATH.finditer(text)
                      if not PLACEHOLDER.search(m.group(1)) and not (ROOT / m.group(1)).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize(("where", "file", "name"), CITATIONS, ids=[f"{w}:{n or f}" for w, f, n in CITATIONS])
def test_every_cited_test_exists(where: str, file: str, name: str | None):
    assert file, f"{where}: `::{name}` without a test file named before it in its row or paragraph"
    path = ROOT / "tests" / file
    assert path.is_file(), f"{where}: no test file tests/{file}"
    if name is not None:
        assert fnmatch.filter(_test_names(path), name), f"{where}: tests/{file} has no test {name}"
