"""Agent tags: short labels an admin groups PCs by ("floor-2", "finance", "room=4.12"), and
the rule placement uses to keep to some of them.

A tag is 1..32 characters of lower-case letters, digits and ``- _ . : =``, starting with a letter
or digit; an agent carries at most ``MAX_TAGS``. Tags are compared lower-cased and kept sorted
without repeats, so ``("Finance", "floor-2", "finance")`` is ``("finance", "floor-2")``.

Pure: the agent's settings validate with :func:`parse_tags`, the service and its admin API too;
:func:`tag_exclusions` says which agents a placement's ``include_tags`` / ``exclude_tags`` leave out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from engine.errors import TagError

MAX_TAGS = 16
MAX_TAG_CHARS = 32
_TAG = re.compile(r"[a-z0-9][a-z0-9_.:=-]*")


def parse_tags(values: Any, where: str = "tags") -> tuple[str, ...]:
    """``values`` (a list/tuple of strings) as sorted, unique, lower-cased tags; TagError naming
    ``where`` and the bad tag otherwise."""
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise TagError(f"{where} must be a list of tags, not {type(values).__name__}")
    tags = set()
    for value in values:
        if not isinstance(value, str):
            raise TagError(f"{where}: a tag must be a string, not {value!r}")
        tag = value.strip().lower()
        if not 1 <= len(tag) <= MAX_TAG_CHARS or not _TAG.fullmatch(tag):
            raise TagError(f"{where}: {value!r} is not a tag: use 1..{MAX_TAG_CHARS} lower-case letters, digits "
                           "and - _ . : = (starting with a letter or digit), e.g. floor-2 or dept=finance")
        tags.add(tag)
    if len(tags) > MAX_TAGS:
        raise TagError(f"{where}: {len(tags)} tags, at most {MAX_TAGS} per agent")
    return tuple(sorted(tags))


def tags_from_text(text: str, where: str = "tags") -> tuple[str, ...]:
    """Comma- or space-separated tags as typed on a command line or in a field ("" is none)."""
    return parse_tags([t for t in re.split(r"[,\s]+", text) if t], where)


def reported_tags(value: Any) -> tuple[str, ...]:
    """Tags an agent reported (its status, its registration): the valid ones, others dropped,
    since an older or odd agent must not make its status unreadable."""
    if not isinstance(value, list | tuple):
        return ()
    valid: list[str] = []
    for v in value:
        try:
            valid += parse_tags([v])
        except TagError:
            continue
    return tuple(sorted(set(valid)))[:MAX_TAGS]


def tag_exclusions(tags_by_node: Mapping[str, Iterable[str]], include: Iterable[str] = (),
                   exclude: Iterable[str] = ()) -> dict[str, str]:
    """{node id: why it is left out} for a placement keeping to ``include`` / avoiding ``exclude``.

    An agent is left out when it carries any tag of ``exclude`` (exclusion wins), or when
    ``include`` is given and it carries none of those tags. The reason names the tags, for the
    plan's list of agents left out."""
    include, exclude = parse_tags(list(include), "include_tags"), parse_tags(list(exclude), "exclude_tags")
    out: dict[str, str] = {}
    for node, tags in tags_by_node.items():
        have = set(tags)
        barred = [t for t in exclude if t in have]
        if barred:
            out[node] = f"tagged {', '.join(barred)} (excluded)"
        elif include and not have & set(include):
            out[node] = f"not tagged {' or '.join(include)}"
    return out
