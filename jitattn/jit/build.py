"""Write build.ninja for one module and run ninja on it."""

from __future__ import annotations

import os
import shutil
import signal
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


BUILD_LOG = "build.log"
_cancelled = threading.Event()
_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()


class BuildCancelled(BuildError):
    """The build was stopped by ``cancel_builds()`` (Ctrl-C in ``jitattn-cache warm``); nothing was published."""


def cancel_builds() -> int:
    """Stop every compile this process is running, now, and refuse new ones; returns how many were stopped.

    Each ninja runs in its own process group, so the compilers it started are
    killed with it. Builds raise ``BuildCancelled`` and publish nothing.
    ``reset_cancel()`` allows builds again.
    """
    _cancelled.set()
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(procs)


def reset_cancel() -> None:
    """Allow builds again after ``cancel_builds()``."""
    _cancelled.clear()


def build_cancelled() -> bool:
    return _cancelled.is_set()


def raise_if_cancelled(what: str) -> None:
    if _cancelled.is_set():
        raise BuildCancelled(f"{what}: build cancelled (interrupted); nothing was published")


def run_ninja(work_dir: Path, jobs: int, source_path: Path) -> None:
    """Run ninja in ``work_dir``; on failure raise BuildError with the compiler's message.

    The full output is kept in ``work_dir/build.log``; the message names it.
    """
    global _compile_count
    raise_if_cancelled(str(source_path))
    with _count_lock:
        _compile_count += 1
    env = dict(os.environ)
    env.pop("MAKEFLAGS", None)
    log_path = work_dir / BUILD_LOG
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [_ninja(), "-C", str(work_dir), "-j", str(max(1, jobs))],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )
        with _running_lock:
            _running.add(proc)
        try:
            if _cancelled.is_set():  # cancelled between the check above and the start
                os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            with _running_lock:
                _running.discard(proc)
        if _cancelled.is_set():
            raise BuildCancelled(f"{source_path}: build cancelled (interrupted); nothing was published")
        if returncode == 0:
            return
        log.seek(0)
        output = log.read().strip()
    if len(output) > 20000:
        output = output[:4000] + "\n...\n" + output[-16000:]
    raise BuildError(f"compile failed for {source_path}:\n{output}\n(full log: {log_path})\n"
                     f"(rendered source: {source_path})")
