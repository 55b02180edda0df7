"""docs/MODELS.md's architectures table is the code's list: every family of the builder's
``FAMILIES`` has a row and every row is a family; every GGUF architecture the reader accepts is named
in the GGUF column of the family it exports as, and no other."""

from __future__ import annotations

import re
from pathlib import Path

from export.builder.families import FAMILIES
from export.weights.gguf_source import GGUF_ARCHITECTURES

DOC = Path(__file__).resolve().parents[2] / "docs" / "MODELS.md"


def _rows() -> dict[str, list[str]]:
    """Family -> the cells of its row in the architectures table."""
    text = DOC.read_text(encoding="utf-8")
    table = text.split("## Architectures", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([a-z0-9_]+)`", cells[0]) if line.startswith("|") else None
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} has two rows"
            rows[match.group(1)] = cells
    return rows


def test_the_table_lists_exactly_the_builders_families():
    assert set(_rows()) == set(FAMILIES)


def test_the_gguf_column_names_exactly_the_readers_architectures():
    rows = _rows()
    named = {family: set(re.findall(r"`([a-z0-9_]+)`", row[3].split("(")[0])) for family, row in rows.items()}
    for arch, family in GGUF_ARCHITECTURES.items():
        assert arch in named[family], f"GGUF architecture {arch!r} is not in the {family} row"
    documented = set().union(*named.values())
    assert documented == set(GGUF_ARCHITECTURES)


def test_the_readme_links_the_table():
    assert "docs/MODELS.md" in (DOC.parents[1] / "README.md").read_text(encoding="utf-8")
