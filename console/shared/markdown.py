"""Markdown as the fleet's models write it, to the HTML subset Qt's rich text shows; pure, no Qt.

What it renders: fenced code blocks (``` and ~~~, with a language, each with a "Copy" link
whose address names the block), ATX and setext headings, paragraphs (a single newline is a line
break, as chat windows do, not a space as CommonMark says), bullet and numbered lists (nested by
indentation), block quotes, GitHub tables (with column alignment), horizontal rules, and inline
``code``, **bold**, *italic*, ~~strike~~, links and bare web addresses. Everything else is text:
the input is escaped, so HTML in an answer shows as written and never reaches the document.

Why not Qt's own ``QTextDocument.setMarkdown`` (md4c): it passes raw HTML in an answer through
into the document, and gives no hook per code block for a copy link. Why not a library
(markdown-it-py): it is not among Deskfleet's dependencies, so the agent's .deb and Windows
bundle would grow by two packages for this subset, and its HTML would still need rewriting for
Qt's rich-text subset (tables need ``border``/``cellpadding`` attributes, code blocks a cell to
carry a background). Streaming: :func:`render` is linear in the text, and an unclosed fence is
code to the end, so re-rendering the growing answer shows its code block as it arrives.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

CODE_BG = "#f3f4f6"
TABLE_BORDER = "#d0d4da"
INLINE_CODE_BG = "#eceef1"
TABLE_HEAD_BG = "#e8ebef"
QUOTE_COLOUR = "#5f6368"
COPY_LABEL = "Copy"


@dataclass(frozen=True)
class CodeBlock:
    language: str  # the fence's info word ("python"), "" when none
    text: str  # exactly what the Copy link copies (no trailing newline)


@dataclass(frozen=True)
class Rendered:
    html: str
    code_blocks: tuple[CodeBlock, ...]  # in order; block i's Copy link is f"{copy_prefix}{i}"


def render(text: str, *, copy_prefix: str = "copy:") -> Rendered:
    """``text`` (Markdown) as Qt rich-text HTML, with its code blocks."""
    blocks: list[CodeBlock] = []
    lines = text.replace("\x00", "\ufffd").replace("\r\n", "\n").replace("\r", "\n").expandtabs(4).split("\n")
    return Rendered(_Blocks(blocks, copy_prefix).render(lines), tuple(blocks))


# -- blocks ----------------------------------------------------------------------------------------

FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*$")
HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
RULE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
BULLET = re.compile(r"^( {0,3})([-*+])(?:[ \t]+(.*)|[ \t]*)$")
ORDERED = re.compile(r"^( {0,3})(\d{1,9})([.)])(?:[ \t]+(.*)|[ \t]*)$")
QUOTE = re.compile(r"^ {0,3}>[ ]?(.*)$")
DELIMITER_CELL = re.compile(r"^\s*(:?)-+(:?)\s*$")


def _list_marker(line: str) -> tuple[str, int, int, str] | None:
    """(kind, indent, content column, first line's text) of a list item's first line, or None.
    ``kind`` is the marker character for bullets, ". " or ") " + start number for numbered ones."""
    if RULE.match(line):
        return None
    if m := BULLET.match(line):
        content = m.group(3) or ""
        column = len(line) - len(content) if content else len(m.group(1)) + 2
        return m.group(2), len(m.group(1)), column, content
    if m := ORDERED.match(line):
        content = m.group(4) or ""
        column = len(line) - len(content) if content else len(m.group(1)) + len(m.group(2)) + 2
        return m.group(3) + m.group(2), len(m.group(1)), column, content
    return None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _split_row(line: str) -> list[str]:
    """A table row's cells: split at ``|`` outside code spans and not escaped; outer pipes dropped."""
    row = line.strip()
    if row.startswith("|"):
        row = row[1:]
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    cells, current, i, ticks = [], [], 0, 0
    while i < len(row):
        c = row[i]
        if c == "\\" and i + 1 < len(row) and row[i + 1] == "|":
            current.append("|")
            i += 2
            continue
        if c == "`":
            run = len(row[i:]) - len(row[i:].lstrip("`"))
            ticks = 0 if ticks == run else (run if ticks == 0 else ticks)
            current.append(row[i:i + run])
            i += run
            continue
        if c == "|" and ticks == 0:
            cells.append("".join(current).strip())
            current = []
        else:
            current.append(c)
        i += 1
    cells.append("".join(current).strip())
    return cells


def _table_alignments(line: str) -> list[str] | None:
    """The alignments of a delimiter row (``|:--|--:|``), or None when ``line`` is not one."""
    if "-" not in line or not re.fullmatch(r"[\s|:\-]+", line):
        return None
    aligns = []
    for cell in _split_row(line):
        m = DELIMITER_CELL.match(cell)
        if m is None:
            return None
        left, right = bool(m.group(1)), bool(m.group(2))
        aligns.append("center" if left and right else "right" if right else "left")
    return aligns


def _starts_table(lines: list[str], i: int) -> bool:
    if "|" not in lines[i] or i + 1 >= len(lines):
        return False
    aligns = _table_alignments(lines[i + 1])
    return aligns is not None and len(aligns) == len(_split_row(lines[i]))


class _Blocks:
    def __init__(self, code_blocks: list[CodeBlock], copy_prefix: str) -> None:
        self.code_blocks = code_blocks
        self.copy_prefix = copy_prefix

    def render(self, lines: list[str], *, tight: bool = False) -> str:
        """The HTML of ``lines``; ``tight``: a list item's, whose lone paragraph needs no <p>."""
        out: list[str] = []
        paragraphs = 0
        i = 0
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                i += 1
            elif m := FENCE.match(line):
                i = self._fence(lines, i, m, out)
            elif m := HEADING.match(line):
                level = len(m.group(1))
                out.append(f"<h{level}>{inline(m.group(2) or '')}</h{level}>")
                i += 1
            elif RULE.match(line):
                out.append("<hr/>")
                i += 1
            elif QUOTE.match(line):
                i = self._quote(lines, i, out)
            elif _list_marker(line) is not None:
                i = self._list(lines, i, out)
            elif _starts_table(lines, i):
                i = self._table(lines, i, out)
            else:
                i = self._paragraph(lines, i, out)
                paragraphs += 1
        if tight and paragraphs == 1 and out and out[0].startswith("<p>"):
            out[0] = out[0][3:-4]  # a tight item's text sits on the bullet's line, without margins
        return "".join(out)

    def _fence(self, lines: list[str], i: int, m: re.Match, out: list[str]) -> int:
        indent, fence, language = len(m.group(1)), m.group(2), m.group(3)
        if fence[0] == "`" and "`" in language:
            return self._paragraph(lines, i, out)
        body: list[str] = []
        i += 1
        while i < len(lines):  # an unclosed fence (an answer still streaming) runs to the end
            closing = lines[i].strip()
            if closing and set(closing) == {fence[0]} and len(closing) >= len(fence) and _indent(lines[i]) < 4:
                i += 1
                break
            body.append(lines[i][min(indent, _indent(lines[i])):])
            i += 1
        code = "\n".join(body)
        index = len(self.code_blocks)
        self.code_blocks.append(CodeBlock(language, code))
        label = html.escape(language) if language else "code"
        copy = f'<a href="{html.escape(self.copy_prefix, quote=True)}{index}">{COPY_LABEL}</a>'
        out.append(f'<table width="100%" cellspacing="0" cellpadding="6" border="0" bgcolor="{CODE_BG}">'
                   f'<tr><td><span style="color: {QUOTE_COLOUR};">{label}</span></td>'
                   f'<td align="right">{copy}</td></tr>'
                   f'<tr><td colspan="2"><pre>{html.escape(code, quote=False)}</pre></td></tr></table>')
        return i

    def _quote(self, lines: list[str], i: int, out: list[str]) -> int:
        body: list[str] = []
        while i < len(lines) and lines[i].strip():
            m = QUOTE.match(lines[i])
            if m is None and (FENCE.match(lines[i]) or _list_marker(lines[i]) or HEADING.match(lines[i])):
                break
            body.append(m.group(1) if m else lines[i])  # a line without ">" continues the quote's paragraph
            i += 1
        out.append(f'<blockquote style="color: {QUOTE_COLOUR};">{self.render(body)}</blockquote>')
        return i

    def _list(self, lines: list[str], i: int, out: list[str]) -> int:
        kind, indent, _, _ = _list_marker(lines[i])  # type: ignore[misc]
        ordered = kind[0] not in "-*+"
        items: list[list[str]] = []
        while i < len(lines):
            marker = _list_marker(lines[i])
            if marker is None or marker[0][0] != kind[0] or marker[1] > indent + 1 and items:
                break
            _, _, column, first = marker
            item = [first]
            i += 1
            while i < len(lines):
                line = lines[i]
                if not line.strip():
                    following = next((n for n in lines[i + 1:] if n.strip()), None)
                    if following is None or _indent(following) < column:
                        break
                    item.append("")
                elif _indent(line) >= column:
                    item.append(line[column:])
                elif _indent(line) > indent and _list_marker(line) is not None:
                    item.append(line[_indent(line):] if _indent(line) < column else line[column:])
                elif (_list_marker(line) is None and not FENCE.match(line) and not HEADING.match(line)
                      and not QUOTE.match(line) and not RULE.match(line) and item[-1].strip()):
                    item.append(line.strip())  # a lazy continuation of the item's paragraph
                else:
                    break
                i += 1
            items.append(item)
            while i < len(lines) and not lines[i].strip():
                following = next((n for n in lines[i:] if n.strip()), None)
                same = following is not None and (_list_marker(following) or ("",))[0][:1] == kind[0]
                if not same:
                    break
                i += 1
        tag = "ol" if ordered else "ul"
        start = int(kind[1:]) if ordered else 1
        opening = f'<ol start="{start}">' if ordered and start != 1 else f"<{tag}>"
        out.append(opening + "".join(f"<li>{self.render(item, tight=True)}</li>" for item in items) + f"</{tag}>")
        return i

    def _table(self, lines: list[str], i: int, out: list[str]) -> int:
        head = _split_row(lines[i])
        aligns = _table_alignments(lines[i + 1]) or []
        rows: list[list[str]] = []
        i += 2
        while i < len(lines) and lines[i].strip() and "|" in lines[i]:
            rows.append(_split_row(lines[i]))
            i += 1

        def cells(row: list[str], tag: str) -> str:
            row = (row + [""] * len(aligns))[:len(aligns)]
            background = f' bgcolor="{TABLE_HEAD_BG}"' if tag == "th" else ""
            return "".join(f'<{tag} align="{align}"{background}>{inline(cell)}</{tag}>'
                           for cell, align in zip(row, aligns, strict=True))

        body = "".join(f"<tr>{cells(r, 'td')}</tr>" for r in rows)
        out.append(f'<table border="1" cellspacing="0" cellpadding="5" style="border-collapse: collapse; '
                   f'border-color: {TABLE_BORDER};"><tr>{cells(head, "th")}</tr>{body}</table>')
        return i

    def _paragraph(self, lines: list[str], i: int, out: list[str]) -> int:
        body = [lines[i].strip()]
        i += 1
        while i < len(lines):
            line = lines[i]
            if not line.strip():
                break
            if m := SETEXT.match(line):
                level = 1 if m.group(1)[0] == "=" else 2
                out.append(f"<h{level}>{'<br/>'.join(inline(b) for b in body)}</h{level}>")
                return i + 1
            if (FENCE.match(line) or HEADING.match(line) or RULE.match(line) or QUOTE.match(line)
                    or _list_marker(line) is not None or _starts_table(lines, i)):
                break
            body.append(line.strip())
            i += 1
        out.append("<p>" + "<br/>".join(inline(b) for b in body) + "</p>")
        return i


# -- inline ----------------------------------------------------------------------------------------

PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
LINK = re.compile(r"\[((?:[^\[\]\\]|\\.)*)\]\(\s*<?([^\s()<>]*(?:\([^\s()<>]*\)[^\s()<>]*)*)>?"
                  r"(?:\s+\"[^\"]*\")?\s*\)")
AUTOLINK = re.compile(r"<((?:https?://|mailto:)[^\s<>]+)>")
BARE_URL = re.compile(r"(?<![\w/@])https?://[^\s<>\"']+")
SAFE_SCHEMES = ("http://", "https://", "mailto:")
# An emphasis spans at most SPAN characters: an unclosed "**" then costs SPAN steps, not the rest of
# the line (a 12,000-character line of unclosed markers took 0.3-0.5 s unbounded, ~10 ms bounded).
SPAN = 250
EMPHASIS = (
    (re.compile(rf"\*\*(?=\S)(.{{1,{SPAN}}}?)(?<=\S)\*\*"), "b"),
    (re.compile(rf"(?<!\w)__(?=\S)(.{{1,{SPAN}}}?)(?<=\S)__(?!\w)"), "b"),
    (re.compile(rf"~~(?=\S)(.{{1,{SPAN}}}?)(?<=\S)~~"), "s"),
    (re.compile(rf"(?<![*\w])\*(?=[^\s*])(.{{1,{SPAN}}}?)(?<=[^\s*])\*(?![*\w])"), "i"),
    (re.compile(rf"(?<![_\w])_(?=[^\s_])(.{{1,{SPAN}}}?)(?<=[^\s_])_(?![_\w])"), "i"),
)


def _link(url: str, label_html: str) -> str:
    if not url.lower().startswith(SAFE_SCHEMES):
        return label_html  # javascript:, file: and relative addresses: the text only
    return f'<a href="{html.escape(url, quote=True)}">{label_html}</a>'


def inline(text: str) -> str:
    """One line (or table cell) of inline Markdown as escaped HTML."""
    text = text.replace("\x00", "\ufffd")
    kept: list[str] = []  # pieces already HTML, held out of escaping and emphasis as \x00N\x00

    def keep(piece: str) -> str:
        kept.append(piece)
        return f"\x00{len(kept) - 1}\x00"

    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in PUNCTUATION:
            out.append(keep(html.escape(text[i + 1])))
            i += 2
        elif c == "`":
            run = len(text[i:]) - len(text[i:].lstrip("`"))
            close = re.compile(rf"(?<!`){'`' * run}(?!`)").search(text, i + run)
            if close is None:
                out.append(text[i:i + run])
                i += run
                continue
            code = text[i + run:close.start()]
            if len(code) > 2 and code[0] == code[-1] == " " and code.strip():
                code = code[1:-1]
            out.append(keep(f'<code style="background-color: {INLINE_CODE_BG};">'
                            f"{html.escape(code, quote=False)}</code>"))
            i = close.end()
        elif c == "[" and (m := LINK.match(text, i)):
            out.append(keep(_link(m.group(2), inline(m.group(1)))))
            i = m.end()
        elif c == "<" and (m := AUTOLINK.match(text, i)):
            out.append(keep(_link(m.group(1), html.escape(m.group(1)))))
            i = m.end()
        elif c in "hH" and (m := BARE_URL.match(text, i)) and (i == 0 or not text[i - 1].isalnum()):
            url = m.group(0).rstrip(".,;:!?)")
            out.append(keep(_link(url, html.escape(url))))
            i += len(url)
        else:
            out.append(c)
            i += 1
    escaped = html.escape("".join(out), quote=False)
    for pattern, tag in EMPHASIS:
        escaped = pattern.sub(rf"<{tag}>\1</{tag}>", escaped)
    return re.sub(r"\x00(\d+)\x00", lambda m: kept[int(m.group(1))], escaped)
