"""docs/fidelity.md maps each paper's equations to code as `path:line` `symbol` pairs.

Line numbers rot as code moves; this test keeps the map honest: every reference must name an
existing file whose given line contains the given symbol. A failure says where the symbol now is.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "fidelity.md"
REFERENCE = re.compile(r"`([\w./-]+\.(?:py|yaml|yml|toml)):(\d+)`\s*`([^`]+)`")
PAPERS = ("RouteRAG", "PathRouter", "LWS", "GraphRAG-R1", "R1-Router")


def _references() -> list[tuple[str, int, str]]:
    return [(path, int(line), symbol) for path, line, symbol in REFERENCE.findall(DOC.read_text())]


def test_every_paper_has_a_section_with_references():
    text = DOC.read_text()
    for paper in PAPERS:
        assert re.search(rf"^## {re.escape(paper)}\b", text, re.M), f"no section for {paper}"
    assert len(_references()) >= 40


@pytest.mark.parametrize("path,line,symbol", _references())
def test_reference_points_at_its_symbol(path, line, symbol):
    source = ROOT / path
    assert source.is_file(), f"{path} does not exist"
    lines = source.read_text().splitlines()
    assert 1 <= line <= len(lines), f"{path} has {len(lines)} lines, not {line}"
    if symbol not in lines[line - 1]:
        found = [n for n, text in enumerate(lines, 1) if symbol in text]
        pytest.fail(f"{path}:{line} does not contain {symbol!r}; it occurs on lines {found[:5]}")
