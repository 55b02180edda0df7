"""The API's request path runs one way (issue 27): parse → admit → generate → shape.

The rule is the import-linter contract ``api-request-path`` in pyproject.toml (checked on the real
tree with the others by test_architecture_rules.py): each stage imports only the stages before it,
the route handler (server.py) sits on top and strings them together, and the helpers several
stages share sit below and import none. Here: the contract names the stages in the request's
order, and it breaks when a stage reaches forward to a later one or a helper reaches up into one
(on a copy of engine/ with such imports added, linting this contract alone: seconds, not minutes).
"""

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
CONTRACT = next(c for c in CONTRACTS if c.get("id") == "api-request-path")
# the request's stages in the order it passes them: parse (a Responses body into the chat request it
# means, above chat's own parse), admit, generate, shape (chat and completions beside responses)
STAGES = ("openai_schema", "responses_schema", "admit", "generate", "openai_answer : responses_answer")


def test_the_contract_stacks_the_stages_in_the_request_order():
    top, *stages, helpers = CONTRACT["layers"]
    assert top == "server" and tuple(reversed(stages)) == STAGES
    assert CONTRACT["containers"] == ["engine.api"] and CONTRACT["exhaustive"]  # a new module must take a floor
    stage_modules = {m.strip() for floor in STAGES for m in floor.split(":")}
    assert "server" not in helpers and not stage_modules & {h.strip() for h in helpers.split(":")}


def _lint_engine_copy(tmp_path: Path, added: dict[str, str]) -> subprocess.CompletedProcess:
    """The contract alone, linted on a copy of engine/ with ``added`` (path -> code) appended."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "engine", tree / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    for path, code in added.items():
        with (tree / path).open("a") as f:
            f.write(code)
    config = tree / "api_path.toml"
    contract = "\n".join(f"{key} = {json.dumps(value)}" for key, value in CONTRACT.items())  # JSON values are TOML
    config.write_text(f'[tool.importlinter]\nroot_packages = ["engine"]\n\n'
                      f'[[tool.importlinter.contracts]]\n{contract}\n')
    return subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                           "from importlinter.cli import lint_imports_command; lint_imports_command()",
                           str(config), "--no-cache"], cwd=tree, capture_output=True, text=True,
                          timeout=300)


def test_the_contract_holds_and_breaks_when_a_stage_reaches_forward(tmp_path):
    kept = _lint_engine_copy(tmp_path / "as_is", {})
    assert kept.returncode == 0, kept.stdout + kept.stderr
    result = _lint_engine_copy(tmp_path / "bad", {
        # parse asking admission, generate shaping, a helper reaching up into a stage (local imports count)
        "engine/api/openai_schema.py": "\n\ndef _sneaky():\n    from engine.api import admit\n",
        "engine/api/generate.py": "\n\ndef _sneaky():\n    from engine.api.openai_answer import Answer\n",
        "engine/api/share.py": "\nfrom engine.api.generate import Tally\n",
    })
    assert result.returncode != 0
    for edge in ("engine.api.openai_schema -> engine.api.admit", "engine.api.generate -> engine.api.openai_answer",
                 "engine.api.share -> engine.api.generate"):
        assert edge in result.stdout, result.stdout
