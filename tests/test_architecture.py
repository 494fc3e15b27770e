"""The architecture's rules as checks (docs/ARCHITECTURE.md): the layers and the CLI's reach (.importlinter,
run by import-linter), and no module importing another module's private names."""

from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    from importlinter.cli import lint_imports  # the test extra: pip install -e ".[test]"

    cwd = os.getcwd()
    os.chdir(REPO)  # the contracts name the packages from the repository root
    try:
        assert lint_imports(config_filename=str(REPO / ".importlinter"), no_cache=True, no_logo=True) == 0, (
            "an import breaks a contract of .importlinter (the output above names it): move the code to the layer "
            "it belongs to, or import a public name from a lower layer")
    finally:
        os.chdir(cwd)


def test_no_module_imports_another_modules_private_names() -> None:
    offenders = []
    for path in sorted([*REPO.joinpath("jitattn").rglob("*.py"), *REPO.joinpath("jitattn_cache").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                offenders += [f"{path.relative_to(REPO)}:{node.lineno} imports {a.name} from {node.module}"
                              for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, "private names used across modules (make them public or move the code):\n" + "\n".join(
        offenders)
