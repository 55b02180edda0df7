"""The tests that need a CPU feature, listed: each one goes through tests/support/cpu_needs.py, says
its feature in its name and why it needs it, and no other test skips (or checks only on one CPU
kind) for a reason of the CPU's. The pool has AVX2-only and avx512_bf16 CPUs: the suite must pass
on both, and what one kind cannot run must be visible in the test's name and its skip reason.

Read from the sources (ast), nothing imported but the modules that use ``needs_cpu``."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tests.support import cpu_needs
from tests.support.cpu_needs import FEATURES, CpuNeed, CpuNeedError, name_suffix, needs_cpu

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
HELPER = TESTS / "support" / "cpu_needs.py"
# Words that make a skip or a branch in a test depend on the CPU kind.
CPU_WORDS = re.compile(r"bf16|bfloat16|avx|amx|OPTIMIZATION_CAPABILITIES|cpuinfo|cpu_has|cpu_capabilities", re.I)
SKIPS = {"skip", "skipif", "xfail", "importorskip"}


def _sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p != HELPER and p != Path(__file__).resolve())


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _call_name(node: ast.AST) -> str | None:
    func = node.func if isinstance(node, ast.Call) else node
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def declared_needs() -> list[CpuNeed]:
    """Every ``@needs_cpu(feature, why)`` in tests/, read from the sources."""
    found = []
    for path in _sources():
        text = path.read_text()
        if "needs_cpu" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and _call_name(deco) == "needs_cpu":
                    feature, why = (ast.literal_eval(arg) for arg in deco.args[:2])
                    found.append(CpuNeed(f"{_module(path)}::{node.name}", feature, why))
    return found


def cpu_dependent_checks_elsewhere(paths: list[Path] | None = None) -> list[str]:
    """Skips, xfails, and ``if`` branches inside test functions, whose condition names a CPU feature without
    going through ``needs_cpu``: a test that passes on one CPU kind and silently checks less on the other."""
    bad = []
    for path in _sources() if paths is None else paths:
        text = path.read_text()
        if not CPU_WORDS.search(text):
            continue
        tree = ast.parse(text)
        in_tests = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                    and f.name.startswith("test") for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) in SKIPS:
                condition = " ".join(ast.get_source_segment(text, a) or "" for a in node.args)
            elif isinstance(node, ast.If | ast.IfExp) and id(node) in in_tests:  # a branch inside a test
                condition = ast.get_source_segment(text, node.test) or ""
            else:
                continue
            if CPU_WORDS.search(condition):
                bad.append(f"{path.name}:{node.lineno}: {condition.strip()[:100]}")
    return sorted(bad, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def test_every_cpu_dependent_test_names_its_feature_and_says_why():
    needs = declared_needs()
    print("\ntests that need a CPU feature (skipped elsewhere, with the reason):")
    for need in needs:
        print(f"  {need.test}\n    needs {need.feature}: {need.why}")
    assert needs, "the bf16 paged-stage test at least needs avx512_bf16; the scan found nothing"
    for need in needs:
        assert need.feature in FEATURES, need
        assert name_suffix(need.feature) in need.test.split("::")[1], need
        assert len(need.why.split()) >= 5, f"{need.test}: say why it needs {need.feature}, and where else it is tested"
    # what the decorator registered at import is what the sources declare
    for module in sorted({n.test.split("::")[0] for n in needs}):
        importlib.import_module(module)
    assert sorted(cpu_needs.REGISTRY, key=lambda n: n.test) == sorted(needs, key=lambda n: n.test)


def test_no_test_skips_or_branches_on_the_cpu_kind_outside_needs_cpu():
    assert cpu_dependent_checks_elsewhere() == []


def test_needs_cpu_skips_with_its_reason_and_refuses_a_name_without_the_feature():
    registry: list[CpuNeed] = []

    def test_bf16_on_an_avx512_bf16_cpu():
        pass

    marked = needs_cpu("avx512_bf16", "the plugin compiles bf16 only there", registry)(test_bf16_on_an_avx512_bf16_cpu)
    (mark,) = marked.pytestmark
    assert mark.name == "skipif" and mark.args == (not cpu_needs.cpu_has("avx512_bf16"),)
    assert mark.kwargs["reason"] == "needs a CPU with avx512_bf16: the plugin compiles bf16 only there"
    assert registry == [CpuNeed(f"{__name__}::test_bf16_on_an_avx512_bf16_cpu", "avx512_bf16",
                                "the plugin compiles bf16 only there")]

    def test_bf16():
        pass

    with pytest.raises(CpuNeedError, match="its name must say so .*on_an_avx512_bf16_cpu"):
        needs_cpu("avx512_bf16", "the plugin compiles bf16 only there", registry)(test_bf16)
    with pytest.raises(CpuNeedError, match="unknown CPU feature 'avx9'"):
        needs_cpu("avx9", "why")
    with pytest.raises(CpuNeedError, match="must say why"):
        needs_cpu("avx512_bf16", " ")
    assert len(registry) == 1


def test_the_scan_finds_a_cpu_dependent_skip_that_bypasses_needs_cpu(tmp_path):
    rogue = tmp_path / "test_rogue.py"
    rogue.write_text('import pytest\n\n@pytest.mark.skipif("BF16" not in caps, reason="x")\ndef test_a():\n'
                     '    pass\n\n\ndef test_b(compiled):\n    if compiled == {"bf16"}:\n        assert True\n')
    assert [line.split(": ", 1)[0] for line in cpu_dependent_checks_elsewhere([rogue])] == [
        "test_rogue.py:3", "test_rogue.py:9"]
