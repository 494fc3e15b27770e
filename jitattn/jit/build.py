"""Write build.ninja for one module and run ninja on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

from ..spec import Target
from .errors import BuildError
from .toolchain import Toolchain

LIBRARY_NAME = "lib.so"
_compile_count = 0
_count_lock = threading.Lock()


def compile_count() -> int:
    """How many compiler runs (ninja invocations) this process has made."""
    return _compile_count


def _ninja() -> str:
    try:
        import ninja  # the PyPI package ships a binary

        path = Path(ninja.BIN_DIR) / "ninja"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    path = shutil.which("ninja")
    if path is None:
        raise BuildError("ninja not found: pip install ninja (a jitattn dependency) or put ninja on PATH")
    return path


def _quote(path: Path | str) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def write_ninja(
    work_dir: Path, sources: list[str], target: Target, toolchain: Toolchain,
    cflags: tuple[str, ...], ldflags: tuple[str, ...], include_dir: Path,
) -> Path:
    """build.ninja with absolute paths: one object per source, one shared library."""
    compiler = _quote(toolchain.compiler)
    include = f"-I{_quote(work_dir / 'sources')} -I{_quote(include_dir)}"
    lines = [
        "ninja_required_version = 1.3",
        f"cflags = {' '.join(cflags)} {include}",
        f"ldflags = {' '.join(ldflags)}",
        "rule compile",
        f"  command = {compiler} $cflags -c $in -o $out",
        "  description = compile $in",
        "rule link",
        f"  command = {compiler} $ldflags $in -o $out",
        "  description = link $out",
    ]
    objects = []
    for name in sources:
        obj = work_dir / "obj" / (name + ".o")
        objects.append(_quote(obj))
        lines.append(f"build {_quote(obj)}: compile {_quote(work_dir / 'sources' / name)}")
    lines.append(f"build {_quote(work_dir / LIBRARY_NAME)}: link {' '.join(objects)}")
    lines.append(f"default {_quote(work_dir / LIBRARY_NAME)}")
    path = work_dir / "build.ninja"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_ninja(work_dir: Path, jobs: int, source_path: Path) -> None:
    """Run ninja in ``work_dir``; on failure raise BuildError with the compiler's message."""
    global _compile_count
    with _count_lock:
        _compile_count += 1
    env = dict(os.environ)
    env.pop("MAKEFLAGS", None)
    proc = subprocess.run(
        [_ninja(), "-C", str(work_dir), "-j", str(max(1, jobs))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    if proc.returncode != 0:
        output = proc.stdout.strip()
        if len(output) > 20000:
            output = output[:4000] + "\n...\n" + output[-16000:]
        raise BuildError(f"compile failed for {source_path}:\n{output}\n(rendered source: {source_path})")
