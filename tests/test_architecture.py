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


# The functions over 80 lines and the modules over 500 lines in jitattn/ and jitattn_cache/, at their length
# today. The list only shrinks: split one and delete its line; nothing joins it and none of them grows.
LONG_FUNCTIONS: dict[str, int] = {}
LONG_MODULES: dict[str, int] = {}
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 500


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{prefix}{node.name}.")


def test_functions_and_modules_stay_short() -> None:
    too_long = []
    for path in sorted([*REPO.joinpath("jitattn").rglob("*.py"), *REPO.joinpath("jitattn_cache").rglob("*.py")]):
        name, source = str(path.relative_to(REPO)), path.read_text()
        lines = len(source.splitlines())
        if lines > LONG_MODULES.get(name, MAX_MODULE_LINES):
            too_long.append(f"{name}: {lines} lines (limit {LONG_MODULES.get(name, MAX_MODULE_LINES)})")
        for function, length in _functions(ast.parse(source)):
            limit = LONG_FUNCTIONS.get(f"{name}::{function}", MAX_FUNCTION_LINES)
            if length > limit:
                too_long.append(f"{name}::{function}: {length} lines (limit {limit})")
    assert not too_long, ("split these into named steps (a module of one idea, functions of at most "
                          f"{MAX_FUNCTION_LINES} lines):\n" + "\n".join(too_long))


def test_the_ops_keep_their_short_import_paths() -> None:
    """jitattn.decode, jitattn.cascade, ... are the jitattn.ops modules (one module object, imported once)."""
    import importlib

    import jitattn.ops

    for name in ("attention", "attention_sink", "batch_attention", "cascade", "decode", "mla", "page", "pod",
                 "prefill", "rope", "shared_prefix", "sparse"):
        short = importlib.import_module(f"jitattn.{name}")
        assert short is importlib.import_module(f"jitattn.ops.{name}") is getattr(jitattn, name), name
    from jitattn.cascade import MultiLevelCascadeAttentionWrapper

    assert MultiLevelCascadeAttentionWrapper is jitattn.ops.cascade.MultiLevelCascadeAttentionWrapper
