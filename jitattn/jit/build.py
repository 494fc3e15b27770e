"""Write build.ninja for one module and run ninja on it."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from ..env import build_timeout
from ..spec import Target
from .errors import BuildError
from .toolchain import Toolchain

LIBRARY_NAME = "lib.so"
_compile_count = 0
_count_lock = threading.Lock()


def compile_count() -> int:
    """How many compiler runs (ninja invocations) this process has made."""
    return _compile_count


def ninja_path() -> str:
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
    """A path in a ninja build line (ninja shell-quotes it itself where it becomes ``$in`` / ``$out``)."""
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _shell_word(path: Path | str) -> str:
    """A path inside a ninja command (the compiler, an include directory): quoted for the shell that runs it,
    then ninja's ``$`` escaped (a cache under a directory with a space or a quote must build too)."""
    return shlex.quote(str(path)).replace("$", "$$")


def write_ninja(
    work_dir: Path, sources: list[str], target: Target, toolchain: Toolchain,
    cflags: tuple[str, ...], ldflags: tuple[str, ...], include_dir: Path,
) -> Path:
    """build.ninja with absolute paths: one object per source, one shared library."""
    compiler = _shell_word(toolchain.compiler)
    include = f"-I{_shell_word(work_dir / 'sources')} -I{_shell_word(include_dir)}"
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


class BuildKilled(BuildError):
    """ninja itself died of a signal (Ctrl-C, the OOM killer, kill): not a compile error, so nothing is kept."""


class BuildTimedOut(BuildKilled):
    """The build ran past JITATTN_BUILD_TIMEOUT (a hung compiler, or a machine far too busy): it was stopped, and
    nothing is kept or published."""


def cancel_builds() -> int:
    """Stop every compile this process is running, now, and refuse new ones; returns how many were stopped.

    Each ninja runs in a session of its own and starts every command in a
    process group of its own; ninja and each of those groups get SIGKILL, so no
    compiler outlives the call. Builds raise ``BuildCancelled`` and publish nothing.
    ``reset_cancel()`` allows builds again.
    """
    _cancelled.set()
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        _kill_tree(proc.pid)
    return len(procs)


def _process_groups_below(pid: int) -> set[int]:
    """Process groups of ``pid``'s descendants (Linux /proc; empty elsewhere).

    ninja starts each command in a process group of its own (so a terminal's
    Ctrl-C reaches ninja alone); killing ninja's group would leave the compilers
    running, so their groups are killed too.
    """
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return set()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append((int(name), int(fields[2])))
    groups, pending = set(), [pid]
    while pending:
        for child, group in children.get(pending.pop(), []):
            groups.add(group)
            pending.append(child)
    return groups


def _kill_tree(pid: int) -> None:
    """SIGKILL ninja (``pid``, leader of its own session) and every compiler it started."""
    groups = _process_groups_below(pid) | {pid}
    groups.discard(os.getpgrp())  # never our own group
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def reset_cancel() -> None:
    """Allow builds again after ``cancel_builds()``."""
    _cancelled.clear()


def build_cancelled() -> bool:
    return _cancelled.is_set()


def raise_if_cancelled(what: str) -> None:
    if _cancelled.is_set():
        raise BuildCancelled(f"{what}: build cancelled (interrupted); nothing was published")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _timed_out(source_path: Path, limit: float, log) -> str:
    """The message of a build stopped at its time limit: what ran last (the log's tail) and what to do."""
    log.seek(0)
    tail = "\n".join(log.read().strip().splitlines()[-5:])
    return (f"{source_path}: the build did not finish in {limit:g} s (JITATTN_BUILD_TIMEOUT) and was stopped; "
            "nothing was published. A kernel builds in seconds to a few minutes: check the toolchain "
            "(`jitattn-cache doctor`), or on a slow or busy machine raise JITATTN_BUILD_TIMEOUT (0: no limit)"
            + (f"\nlast build output:\n{tail}" if tail else ""))


def run_ninja(work_dir: Path, jobs: int, source_path: Path) -> None:
    """Run ninja in ``work_dir``; on failure raise BuildError with the compiler's message.

    The full output is kept in ``work_dir/build.log``; the message names it.
    """
    global _compile_count
    raise_if_cancelled(str(source_path))
    limit = build_timeout()  # (a bad setting is refused before anything starts)
    with _count_lock:
        _compile_count += 1
    env = dict(os.environ)
    env.pop("MAKEFLAGS", None)
    log_path = work_dir / BUILD_LOG
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [ninja_path(), "-C", str(work_dir), "-j", str(max(1, jobs))],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )
        with _running_lock:
            _running.add(proc)
        try:
            if _cancelled.is_set():  # cancelled between the check above and the start
                _kill_tree(proc.pid)
            try:
                returncode = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid)
                proc.wait()
                raise BuildTimedOut(_timed_out(source_path, limit, log)) from None
        except BaseException:
            _kill_tree(proc.pid)
            proc.wait()
            raise
        finally:
            with _running_lock:
                _running.discard(proc)
        if _cancelled.is_set():
            raise BuildCancelled(f"{source_path}: build cancelled (interrupted); nothing was published")
        if returncode == 0:
            return
        if returncode < 0:
            # A Ctrl-C can reach ninja in the instant between its fork and its setsid, before the
            # interrupted process has cancelled anything: a signal is never the source's fault.
            raise BuildKilled(f"{source_path}: the build was killed by {_signal_name(-returncode)} before it "
                              "finished (interrupted, or out of memory); nothing was published. Run it again")
        log.seek(0)
        output = log.read().strip()
    if len(output) > 20000:
        output = output[:4000] + "\n...\n" + output[-16000:]
    raise BuildError(f"compile failed for {source_path}:\n{output}\n(full log: {log_path})\n"
                     f"(rendered source: {source_path})")
