"""The architecture's rules as checks (docs/ARCHITECTURE.md): the layers and the CLI's reach (.importlinter,
run by import-linter), and no module importing another module's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    # In a process of its own: import-linter configures logging, which the suite's log tests read.
    code = ("import sys; from importlinter.cli import lint_imports; "  # the test extra: pip install -e ".[test]"
            "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        "an import breaks a contract of .importlinter: move the code to the layer it belongs to, or import a public "
        f"name from a lower layer\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")


def test_no_module_imports_another_modules_private_names() -> None:
    offenders = []
    for path in sorted([*REPO.joinpath("jitattn").rglob("*.py"), *REPO.joinpath("jitattn_cache").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                offenders += [f"{path.relative_to(REPO)}:{node.lineno} imports {a.name} from {node.module}"
                              for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, "private names used across modules (make them public or move the code):\n" + "\n".join(
        offenders)
