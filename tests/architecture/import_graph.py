"""Import cycles between Deskfleet's modules, found on grimp's import graph.

Every import counts: module-level, inside a function, and under ``if TYPE_CHECKING:`` (a cycle
hidden in a function or behind a type annotation is still two modules that each need the other).
``python tests/architecture/import_graph.py ROOT`` prints the cycles of the tree at ROOT, one a
line, and exits 1 if there is any (the tests run it on a copy of the tree with a cycle added).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import grimp

PACKAGES = ("engine", "export", "agent", "console", "installer")


def strongly_connected(graph: grimp.ImportGraph) -> Iterator[set[str]]:
    """The modules that import each other, directly or not, one set per group of two or more
    (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            step_down = next((m for m in imported if m not in index or m in on_stack), None)
            if step_down is not None and step_down not in index:
                index[step_down] = low[step_down] = len(index)
                stack.append(step_down)
                on_stack.add(step_down)
                work.append((step_down, iter(sorted(graph.find_modules_directly_imported_by(step_down)))))
                continue
            if step_down is not None:  # already on the stack: a way back
                low[module] = min(low[module], index[step_down])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == module:
                        break
                if len(group) > 1:
                    yield group


def describe(graph: grimp.ImportGraph, group: set[str]) -> str:
    """One cycle through ``group``, with the line of each import: ``a (l.3) -> b (l.9) -> a``."""
    start = min(group)
    back = min((graph.find_shortest_chain(importer=m, imported=start) or ()
                for m in graph.find_modules_directly_imported_by(start) if m in group), key=len)
    chain = (start, *back)
    hops = []
    for importer, imported in zip(chain, chain[1:], strict=False):
        lines = sorted(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))
        hops.append(f"{importer} (l.{','.join(map(str, lines))})")
    more = f"  [{len(group)} modules import each other]" if len(group) > len(chain) - 1 else ""
    return " -> ".join([*hops, start]) + more


def import_cycles(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Every cycle among ``packages``' modules, described (empty: none)."""
    graph = grimp.build_graph(*packages, cache_dir=None)
    return sorted(describe(graph, group) for group in strongly_connected(graph))


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    cycles = import_cycles()
    print("\n".join(cycles) or "no import cycles")
    sys.exit(1 if cycles else 0)
