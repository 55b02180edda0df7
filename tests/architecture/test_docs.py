"""The docs stay in step with the code: every file docs/ARCHITECTURE.md and the README name
exists, every linked document exists, every top-level package appears in the architecture's
table, and the README still opens with its two commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCH = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"
PATH = re.compile(r"`((?:engine|export|agent|console|installer|tests|assets)/[A-Za-z0-9_./-]+)`")
LINK = re.compile(r"\]\(((?:docs/)?[A-Z_]+\.md)\)")


def _named_paths(text: str) -> set[str]:
    return {m.rstrip("/") for m in PATH.findall(text)}


def test_every_file_the_docs_name_exists():
    for doc in (ARCH, README):
        names = _named_paths(doc.read_text())
        assert len(names) >= 4, doc  # the check sees the docs at all
        missing = sorted(n for n in names if not (ROOT / n).exists())
        assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_linked_documents_exist():
    for doc in (ARCH, README):
        for link in LINK.findall(doc.read_text()):
            assert (doc.parent / link).is_file(), f"{doc.name} links {link}"
    readme = README.read_text()
    for name in ("docs/ARCHITECTURE.md", "docs/PROTOCOL.md", "docs/CONTROL_API.md", "docs/BENCHMARKS.md"):
        assert f"]({name})" in readme


def test_every_package_is_described():
    table = ARCH.read_text().split("## Processes")[0]
    for package in ("engine", "export", "agent/service", "agent/tray", "console/service", "installer"):
        assert f"| `{package}/`" in table


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    assert text.index("## Two commands") < text.index("## Commands") < text.index("## For employees") \
        < text.index("## For admins") < text.index("## For developers")
    assert 'bash installer/bootstrap.sh && deskfleet demo --prompt "What is the capital of France?"' in text
    assert "bash installer/bootstrap.sh && python3 -m pytest\n" in text
