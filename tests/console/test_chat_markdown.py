"""The chat's Markdown renderer (console/shared/markdown.py), pure: what each construct becomes in
Qt's rich-text HTML, that nothing in an answer reaches the document as HTML, and that a code
block's Copy link names the block whose exact text it copies."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from console.shared.markdown import CodeBlock, inline, render


def html(text: str) -> str:
    return render(text).html


def test_fenced_code_keeps_its_text_exactly_and_gets_a_copy_link():
    answer = "Here:\n\n```python\ndef f(x):\n    return x < 2 and \"&\"\n```\n\nand\n~~~\nplain **not bold**\n~~~"
    rendered = render(answer, copy_prefix="copy:3:")
    assert rendered.code_blocks == (CodeBlock("python", 'def f(x):\n    return x < 2 and "&"'),
                                    CodeBlock("", "plain **not bold**"))
    assert rendered.html.count("<pre>") == 2
    assert '<a href="copy:3:0">Copy</a>' in rendered.html and '<a href="copy:3:1">Copy</a>' in rendered.html
    assert "<pre>def f(x):\n    return x &lt; 2 and \"&amp;\"</pre>" in rendered.html
    assert "<b>" not in rendered.html  # no Markdown inside code
    assert ">python<" in rendered.html  # the language is labelled


def test_an_unclosed_fence_is_code_to_the_end_while_it_streams():
    rendered = render("Try this:\n```sh\nls -l\necho hi")
    assert rendered.code_blocks == (CodeBlock("sh", "ls -l\necho hi"),)
    grown = render("Try this:\n```sh\nls -l\necho hi\n```\nDone.")
    assert grown.code_blocks == rendered.code_blocks and "<p>Done.</p>" in grown.html


def test_lists_nest_by_indentation_and_numbered_ones_keep_their_start():
    out = html("- apples\n- pears\n  - green\n  - red\n- plums\n\n3. three\n4. four")
    assert out == ("<ul><li>apples</li><li>pears<ul><li>green</li><li>red</li></ul></li><li>plums</li></ul>"
                   '<ol start="3"><li>three</li><li>four</li></ol>')
    assert html("1. one\n2. two") == "<ol><li>one</li><li>two</li></ol>"
    # a list right after a line of text (models write that) still is a list
    assert html("Steps:\n1. a\n2. b") == "<p>Steps:</p><ol><li>a</li><li>b</li></ol>"


def test_a_list_item_can_hold_code_and_a_second_paragraph():
    rendered = render("1. Install:\n\n   ```\n   pip install x\n   ```\n\n   Then run it.\n2. Done")
    assert rendered.code_blocks == (CodeBlock("", "pip install x"),)
    items = re.findall(r"<li>(.*?)</li>", rendered.html, re.S)
    assert len(items) == 2 and "<p>Then run it.</p>" in items[0] and items[1] == "Done"


def test_tables_with_alignment_escaped_pipes_and_code_cells():
    out = html("| Name | Count | Note |\n|:-----|------:|:----:|\n| a \\| b | 12 | `x|y` |\n| c | 3 |")
    assert '<th align="left"' in out and '<th align="right"' in out and '<th align="center"' in out
    rows = re.findall(r"<tr>(.*?)</tr>", out)
    assert len(rows) == 3
    code = '<code style="background-color: #eceef1;">x|y</code>'
    assert re.findall(r"<td[^>]*>(.*?)</td>", rows[1]) == ["a | b", "12", code]
    assert re.findall(r"<td[^>]*>(.*?)</td>", rows[2]) == ["c", "3", ""]  # a short row is padded
    assert 'border="1"' in out  # Qt draws cell borders only from the attribute


def test_a_pipe_without_a_delimiter_row_is_just_text():
    assert html("a | b\nc | d") == "<p>a | b<br/>c | d</p>"


@pytest.mark.parametrize("source, expected", [
    ("**bold** and __bold__", "<b>bold</b> and <b>bold</b>"),
    ("*it* and _it_ but snake_case_name", "<i>it</i> and <i>it</i> but snake_case_name"),
    ("~~gone~~", "<s>gone</s>"),
    ("2 * 3 * 4", "2 * 3 * 4"),
    ("`a < b` and ``x ` y``", '<code style="background-color: #eceef1;">a &lt; b</code> and '
                              '<code style="background-color: #eceef1;">x ` y</code>'),
    ("`**not bold**`", '<code style="background-color: #eceef1;">**not bold**</code>'),
    ("\\*literal\\*", "*literal*"),
    ("[docs](https://example.org/a?b=1&c=2)", '<a href="https://example.org/a?b=1&amp;c=2">docs</a>'),
    ("[x](javascript:alert(1))", "x"),
    ("see https://example.org/page.", 'see <a href="https://example.org/page">https://example.org/page</a>.'),
    ("<https://example.org>", '<a href="https://example.org">https://example.org</a>'),
    ("an unclosed `tick", "an unclosed `tick"),
])
def test_inline_markup(source, expected):
    assert inline(source) == expected


def test_html_in_an_answer_is_shown_as_text_never_as_markup():
    hostile = '<script>alert(1)</script> <img src=x onerror="y"> <a href="file:///etc">z</a> &amp;'
    for text in (hostile, f"# {hostile}", f"- {hostile}", f"| h |\n|---|\n| {hostile} |", f"> {hostile}"):
        out = html(text)
        assert "<script" not in out and "<img" not in out and '<a href="file' not in out, out
        assert "&lt;script&gt;" in out and "&amp;amp;" in out


def test_headings_rules_quotes_and_line_breaks():
    assert html("# One\n## Two ##\nText") == "<h1>One</h1><h2>Two</h2><p>Text</p>"
    assert html("Title\n=====\n\nSub\n---") == "<h1>Title</h1><h2>Sub</h2>"
    assert html("a\n\n---\n\nb") == "<p>a</p><hr/><p>b</p>"
    assert html("> quoted **x**\n> more") == ('<blockquote style="color: #5f6368;"><p>quoted <b>x</b><br/>more</p>'
                                             "</blockquote>")
    assert html("roses\nviolets") == "<p>roses<br/>violets</p>"  # a newline is a line break in a chat


def test_rendering_is_linear_enough_to_redo_per_frame():
    """A long answer (a 200-row table, 50 code blocks, 400 list items) renders completely; what the
    renderer keeps is proportional, not lost past some size."""
    table = "| a | b |\n|---|---|\n" + "".join(f"| {i} | **{i * i}** |\n" for i in range(200))
    code = "".join(f"```\nline {i}\n```\n" for i in range(50))
    items = "".join(f"- item {i}\n" for i in range(400))
    rendered = render(table + "\n" + code + "\n" + items)
    assert rendered.html.count("<tr>") == 201 + 100 and len(rendered.code_blocks) == 50
    assert rendered.html.count("<li>") == 400 and "<b>39601</b>" in rendered.html


ALLOWED_TAGS = {"a", "b", "i", "s", "code", "pre", "p", "br", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "ul", "ol",
                "li", "blockquote", "table", "tr", "td", "th", "span"}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*"ab <>&\"'`*_~|-:#>=[]()\\!.1 \n\t", "https://x.y", "```", "\n\n", "- ", "1. ",
                                  "| a | b |\n|---|:-:|\n", "[l](javascript:x)", "[l](https://e.f)"]),
                max_size=120).map("".join))
def test_any_text_renders_to_known_tags_only(text):
    rendered = render(text)
    tags = set(re.findall(r"</?([a-zA-Z0-9]+)", rendered.html))
    assert tags <= ALLOWED_TAGS, tags - ALLOWED_TAGS
    hrefs = re.findall(r'href="([^"]*)"', rendered.html)
    assert all(h.startswith(("https://", "http://", "mailto:", "copy:")) for h in hrefs), hrefs
    assert len(rendered.code_blocks) == rendered.html.count("<pre>")
