"""The docs stay in step with the code.

Every relative link in every tracked Markdown file resolves to a file inside the repository
(and to a heading there, when it names one; http, https and mailto links are skipped); every
module path or dotted module name that the README and docs/ write in backticks exists; the
README's "Reading the code" names functions that exist; every top-level package and every floor
of engine/ has its row in docs/ARCHITECTURE.md; the README keeps its two commands. Each check is
a function over a root directory, so the tests at the end show it failing on a small tree.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
ARCH = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"

PACKAGES = ("engine", "export", "agent", "console", "installer", "tests", "assets", "docs")
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target) and ![alt](target); the text may hold one level of brackets or a code span.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...
PATH_IN_CODE = re.compile(rf"^(?:{'|'.join(PACKAGES)})/[A-Za-z0-9_.*/-]*$")
DOTTED_IN_CODE = re.compile(r"^(?:engine|export|agent|console|installer|tests)(?:\.[A-Za-z_]\w*)+$")
FILE_SUFFIXES = {"crt", "key", "pem", "json", "md", "py", "txt", "toml", "svg", "png", "ico", "log"}
LINE_SUFFIX = re.compile(r":\d+(?:-\d+)?$")  # engine/wire/transport.py:482
BARE_MODULE = re.compile(r"^[A-Za-z_][\w-]*\.py$")  # fleet_hub.py: a file of that name exists
NAME_IN_CODE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?$")  # plan_step, RingPath.async_submit
SKIPPED_DIRS = ("build", "dist", "node_modules")


def markdown_files(root: Path) -> list[Path]:
    """The tracked Markdown files under ``root`` (every *.md outside hidden and build folders
    when ``root`` is not a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", "*.md"],
                             capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = b""
    names = [n for n in out.decode().split("\0") if n]
    if names:
        return sorted(root / n for n in names if (root / n).is_file())

    def skipped(part: str) -> bool:
        return part.startswith(".") or part.endswith(".egg-info") or part in SKIPPED_DIRS

    return sorted(p for p in root.rglob("*.md")
                  if not any(skipped(part) for part in p.relative_to(root).parts[:-1]))


def _without_code(text: str) -> str:
    """``text`` without fenced blocks and code spans, where a link is no link."""
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), FENCE.sub("", text))


def code_spans(text: str) -> list[str]:
    return [m.group(2).strip() for m in CODE_SPAN.finditer(FENCE.sub("", text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces
    to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*_]|<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 for repeated headings."""
    seen: dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(match.group(1))
        seen[base] = seen.get(base, -1) + 1
        if seen[base]:
            seen[f"{base}-{seen[base]}"] = 0
    return set(seen)


def links(text: str) -> list[str]:
    prose = _without_code(text)
    return [m.group(1) for m in INLINE_LINK.finditer(prose)] + REFERENCE_LINK.findall(prose)


def broken_links(root: Path, files: Iterable[Path]) -> list[str]:
    """One line per relative link that leaves ``root``, names no existing file, or names a
    heading its Markdown target does not have."""
    root = root.resolve()
    problems = []
    for doc in files:
        where = doc.relative_to(root)
        for target in links(doc.read_text(encoding="utf-8")):
            if SCHEME.match(target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc.resolve()
            if path.startswith("/") or not dest.is_relative_to(root):
                problems.append(f"{where}: {target} leaves the repository")
            elif not dest.exists():
                problems.append(f"{where}: {target} names no file")
            elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
                problems.append(f"{where}: {target} names no heading of {dest.relative_to(root)}")
    return problems


def _module_exists(root: Path, dotted: str) -> bool:
    """A dotted name is a module or package under ``root``, or a name (a class, a function, a
    constant) that the deepest such module mentions."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        files = (base.with_suffix(".py"), base / "__init__.py")
        source = next((p for p in files if p.is_file()), None)
        if source is not None:
            rest = parts[n:]
            text = source.read_text(encoding="utf-8")
            return not rest or re.search(rf"\b{re.escape(rest[0])}\b", text) is not None
    return False


def _path_exists(root: Path, path: str) -> bool:
    path = path.rstrip("/")
    return any(root.glob(path)) if "*" in path else (root / path).exists()


def _python_file_names(root: Path) -> set[str]:
    names = set()
    for _, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d.endswith(".egg-info"))]
        names.update(f for f in files if f.endswith(".py"))
    return names


def stale_code_paths(root: Path, files: Iterable[Path]) -> list[str]:
    """One line per path (`engine/wire/transport.py`, `assets/*.svg`, `stage_worker.py`) or
    dotted module name (`engine.shards.calibration`, `console.loop_thread.LoopThread`) written
    in backticks that names nothing in ``root``."""
    problems = []
    basenames = None
    for doc in files:
        for span in code_spans(doc.read_text(encoding="utf-8")):
            path = LINE_SUFFIX.sub("", span)
            if PATH_IN_CODE.match(path):
                found = _path_exists(root, path)
            elif BARE_MODULE.match(path):
                if basenames is None:
                    basenames = _python_file_names(root)
                found = path in basenames
            elif DOTTED_IN_CODE.match(span) and span.rsplit(".", 1)[1] not in FILE_SUFFIXES:
                found = _module_exists(root, span)
            else:
                continue
            if not found:
                where = doc.relative_to(root)
                problems.append(f"{where}: `{span}` names nothing in the repository")
    return problems


def section(text: str, heading: str) -> str:
    """The body under ``heading`` (any level), up to the next heading of its level or above."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert match, f"no heading {heading!r}"
    rest = text[match.end():]
    blanked = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), rest)  # a `# comment` in code
    end = re.search(rf"^#{{1,{len(match.group(1))}}} ", blanked, re.M)
    return rest[: end.start()] if end else rest


def undefined_names(root: Path, text: str) -> list[str]:
    """Names in backticks (`plan_step`, `RingPath.async_submit`) that no Python file written
    in backticks in ``text`` defines: a walk-through naming a function renamed or moved."""
    spans = code_spans(text)
    sources = [(root / s).read_text(encoding="utf-8") for s in spans
               if PATH_IN_CODE.match(s) and s.endswith(".py") and (root / s).is_file()]
    missing = []
    for name in (s for s in spans if NAME_IN_CODE.match(s)):
        owner, _, member = name.rpartition(".")
        m = re.escape(member)
        wanted = [rf"^\s*(?:async\s+def|def|class)\s+{m}\b|^\s*{m}\s*[:=]"]
        if owner:
            wanted.append(rf"^class\s+{re.escape(owner)}\b")
        if not any(all(re.search(w, src, re.M) for w in wanted) for src in sources):
            missing.append(name)
    return missing


def _prose_docs(root: Path) -> list[Path]:
    return sorted((root / "docs").glob("*.md")) + [root / "README.md"]


# -- the repository ----------------------------------------------------------------------------


def test_every_relative_link_resolves_inside_the_repository():
    files = markdown_files(ROOT)
    assert README in files and ARCH in files and len(files) >= 5, files  # it sees the docs
    assert sum(len(links(f.read_text(encoding="utf-8"))) for f in files) >= 10
    assert broken_links(ROOT, files) == []


def test_every_path_the_docs_write_in_backticks_exists():
    paths = [s for s in code_spans(ARCH.read_text()) if PATH_IN_CODE.match(s)]
    assert len(paths) >= 20  # the check sees the paths
    assert stale_code_paths(ROOT, _prose_docs(ROOT)) == []


def test_every_package_and_every_engine_floor_has_a_row():
    text = ARCH.read_text()
    packages = section(text, "Packages and their rules")
    for package in ("engine", "export", "agent/service", "agent/tray", "console/fleet",
                    "installer", "tests"):
        assert f"| `{package}/` |" in packages, package
    floors = section(text, "engine/ in floors")
    for floor in sorted(p.parent.name for p in (ROOT / "engine").glob("*/__init__.py")):
        assert f"| `{floor}/` |" in floors, f"engine/{floor}/ has no row in the floors table"


def test_the_reading_map_names_real_functions():
    walk = section(README.read_text(), "Reading the code")
    assert len([s for s in code_spans(walk) if NAME_IN_CODE.match(s)]) >= 15  # it sees names
    assert undefined_names(ROOT, walk) == []


def test_readme_keeps_its_two_commands_first():
    text = README.read_text()
    order = ("## Two commands", "## Commands", "## For employees", "## For admins",
             "## For developers", "### Reading the code")
    assert [text.index(h) for h in order] == sorted(text.index(h) for h in order)
    block = section(text, "Two commands").split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    assert 'deskfleet demo --prompt "What is the capital of France?"' in commands[0]
    assert "pytest" in commands[1] or ".ci/run" in commands[1]


# -- each check can fail -----------------------------------------------------------------------


def _tree(tmp_path: Path, guide: str) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "engine" / "wire").mkdir(parents=True)
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "wire" / "__init__.py").write_text("")
    (root / "engine" / "wire" / "transport.py").write_text(
        "class Connection:\n    async def async_send(self):\n        pass\n")
    (root / "docs" / "OTHER.md").write_text("# Other\n\n## Peer identity\n\n## Peer identity\n")
    (root / "docs" / "GUIDE.md").write_text(guide)
    return root


def test_a_link_to_a_missing_file_is_reported(tmp_path):
    root = _tree(tmp_path, "See [other](OTHER.md), [up](../docs/OTHER.md) and [gone](GONE.md).\n")
    assert broken_links(root, markdown_files(root)) == ["docs/GUIDE.md: GONE.md names no file"]


def test_a_link_leaving_the_repository_is_reported(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "ARCHITECTURE.md").write_text("# Design\n")
    root = _tree(tmp_path, "[design](../../shared/ARCHITECTURE.md), [abs](/etc/hosts).\n")
    assert broken_links(root, markdown_files(root)) == [
        "docs/GUIDE.md: ../../shared/ARCHITECTURE.md leaves the repository",
        "docs/GUIDE.md: /etc/hosts leaves the repository",
    ]


def test_a_link_to_a_missing_heading_is_reported(tmp_path):
    root = _tree(tmp_path, "# Guide\n\n[ok](OTHER.md#peer-identity), "
                           "[2nd](OTHER.md#peer-identity-1), [self](#guide), "
                           "[bad](OTHER.md#peers), [bad self](#nowhere)\n")
    assert broken_links(root, markdown_files(root)) == [
        "docs/GUIDE.md: OTHER.md#peers names no heading of docs/OTHER.md",
        "docs/GUIDE.md: #nowhere names no heading of docs/GUIDE.md",
    ]


def test_web_links_and_code_are_not_checked(tmp_path):
    root = _tree(tmp_path, "[site](https://example.org/x.md) [mail](mailto:a@example.org)\n"
                           "`[not](a-link.md)`\n\n```\n[nor](this.md)\n```\n")
    assert links((root / "docs" / "GUIDE.md").read_text()) == ["https://example.org/x.md",
                                                                "mailto:a@example.org"]
    assert broken_links(root, markdown_files(root)) == []


def test_a_stale_module_path_in_backticks_is_reported(tmp_path):
    root = _tree(tmp_path, "`engine/wire/transport.py` `engine/wire/` `engine/transport.py` "
                           "`engine/wire/*.py` `engine/shards/*.py` `transport.py:12` "
                           "`engine/wire/transport.py:3` `fleet_hub.py:168` `settings.json`\n")
    assert stale_code_paths(root, [root / "docs" / "GUIDE.md"]) == [
        "docs/GUIDE.md: `engine/transport.py` names nothing in the repository",
        "docs/GUIDE.md: `engine/shards/*.py` names nothing in the repository",
        "docs/GUIDE.md: `fleet_hub.py:168` names nothing in the repository",
    ]


def test_a_stale_dotted_module_name_is_reported(tmp_path):
    root = _tree(tmp_path, "`engine.wire.transport` `engine.wire.transport.Connection` "
                           "`engine.wire` `engine.transport` `engine.wire.transport.Dialer` "
                           "`console.key`\n")
    assert stale_code_paths(root, [root / "docs" / "GUIDE.md"]) == [
        "docs/GUIDE.md: `engine.transport` names nothing in the repository",
        "docs/GUIDE.md: `engine.wire.transport.Dialer` names nothing in the repository",
    ]


def test_a_renamed_function_in_the_reading_map_is_reported(tmp_path):
    root = _tree(tmp_path, "")
    text = ("`engine/wire/transport.py`: `Connection` `Connection.async_send` `Dialer` "
            "`Connection.pass`")
    assert undefined_names(root, text) == ["Dialer", "Connection.pass"]
