"""The ``jitattn-cache`` command line: pre-warm, inspect and maintain the jitattn kernel cache.

Exit codes: 0 ok; 1 some builds or checks failed (or something was refused);
2 usage error (bad arguments, unknown preset, bad spec text, missing file,
bad --arch, an unusable JITATTN_CACHE_DIR setting); 130 interrupted (Ctrl-C,
SIGTERM or SIGHUP; the cache stays consistent).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from .selection import UsageError, add_selection_args

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


# -- inspect ---------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    from .store import entries, human_size, writable_base

    rows = entries()
    if args.json:
        print(json.dumps([{
            "uri": e.uri, "target": e.target, "arch": e.arch, "size": e.size,
            "built_at": (e.manifest or {}).get("built_at"), "path": str(e.path),
            "layer": "writable" if e.writable else "read-only",
        } for e in rows], indent=2))
        return EXIT_OK
    if rows:
        width = max(len(e.uri) for e in rows) + 2
        print(f"{'URI':{width}s} {'TARGET':6s} {'ARCH':10s} {'SIZE':>10s}  {'BUILT (UTC)':19s}  LAYER")
        for e in rows:
            try:  # (a manifest's time at the calendar's ends does not convert to UTC)
                built = e.built_at.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if e.built_at \
                    else "?"
            except (OverflowError, ValueError):
                built = "?"
            layer = "rw" if e.writable else f"ro {e.base.parent}"
            note = "" if e.manifest is not None else "  (no manifest: see `jitattn-cache verify`)"
            print(f"{e.uri:{width}s} {e.target:6s} {e.arch:10s} {human_size(e.size):>10s}  {built:19s}  {layer}{note}")
    total = sum(e.size for e in rows)
    print(f"{len(rows)} entries, {human_size(total)}")
    problem = _unusable_base(writable_base())  # listed as empty (or as usable), yet no load can use it
    if problem:
        print(f"jitattn-cache: {problem}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


UNSAFE_PATH = "on an unsafe path"  # an entry_load_problem that a permission fix cures, not a removal


def entry_load_problem(e) -> str | None:
    """Why the entry ``e`` does not load here as its module: inconsistent, on an unsafe path (never dlopen'ed then:
    its constructors would run as you), or its library does not load (the libraries it links, its uri, another
    jitattn version's: ``OTHER_VERSION``); None when it loads."""
    from jitattn.jit.admin import LIBRARY_NAME, foreign_entry_problem, library_problem

    from .store import entry_violations

    problem = foreign_entry_problem(e.path)
    if problem is None and (unsafe := entry_violations(e)):
        v = unsafe[0]
        problem = f"{UNSAFE_PATH} ({v.path}: {v.reason}; fix: {v.fix}); jitattn will not load it"
    return problem if problem is not None else library_problem(e.path / LIBRARY_NAME, e.manifest["uri"])


def cmd_info(args: argparse.Namespace) -> int:
    from jitattn.jit.admin import OTHER_VERSION

    from .store import entries, human_size

    query = args.uri
    found = [e for e in entries() if query in (e.uri, e.name)
             or (len(query) >= 6 and str((e.manifest or {}).get("key", "")).startswith(query))]
    if not found:
        print(f"no cache entry matches {query!r} (see `jitattn-cache ls`)", file=sys.stderr)
        return EXIT_FAILED
    bad = 0
    for e in found:
        problem = entry_load_problem(e)
        other = problem is not None and problem.startswith(OTHER_VERSION)
        bad += problem is not None and not other
        print(f"# {e.path}")
        print(f"layer:  {'writable' if e.writable else 'read-only'} ({e.base.parent})")
        print(f"size:   {human_size(e.size)}")
        print(f"status: {'ok' if problem is None else ('OTHER: ' if other else 'BAD: ') + problem}")
        print(json.dumps(e.manifest, indent=2, sort_keys=True) if e.manifest is not None else "(no manifest)")
    return EXIT_FAILED if bad else EXIT_OK  # (a script checking one entry reads the exit status)


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-checksum every entry of every layer, load its library (it must load here, as its module) and check the
    trust rule; --fix removes bad entries from the writable cache (permission problems are reported with their
    fix, never changed)."""
    from jitattn.jit.admin import OTHER_VERSION, layers, remove_entry

    from .store import cache_violations, entries

    rows = entries()
    unsafe = []
    for base in layers():
        if base.parent.exists():
            mine = [e.path for e in rows if e.base == base]
            unsafe += cache_violations(base, mine, writable=base == layers()[-1])
    for v in unsafe:
        print(f"UNSAFE {v.path}: {v.reason}\n  fix: {v.fix}")
    bad = unfixed = other = permission = 0
    for e in rows:
        problem = entry_load_problem(e)
        if problem is None:
            continue
        if problem.startswith(OTHER_VERSION):  # a cache two versions share: theirs, kept
            other += 1
            print(f"OTHER {e.path}: {problem}; kept (this version never loads it: its own key differs)")
            continue
        bad += 1
        permission += problem.startswith(UNSAFE_PATH)
        print(f"BAD {e.path}: {problem}")
        if not args.fix:
            unfixed += 1
        elif not e.writable:
            unfixed += 1
            print(f"  not removed: {e.base.parent} is a read-only layer (JITATTN_CACHE_PATH); fix or replace it there")
        elif problem.startswith(UNSAFE_PATH):  # a path's permissions keep it from loading (and from being checked)
            unfixed += 1
            print("  not removed: a permission problem, which --fix never changes (its fix is above); verify again "
                  "after it to check the entry itself")
        else:
            try:
                removed = remove_entry(e.base, e.path)
            except OSError as exc:  # this entry's (or its directory's) permissions; the rest are still checked
                unfixed += 1
                print(f"  not removed: {exc.strerror or exc} ({exc.filename or e.path}); give yourself write access "
                      f"to it and to {e.base} (chmod u+rwx), or remove it by hand")
                continue
            if removed:
                print("  removed")
            else:
                unfixed += 1
                print("  not removed: its lock is held (a build of it is running); try again")
    print(f"verify: {len(rows)} entries, {len(rows) - bad - other} ok, {bad} bad"
          + (f", {other} of another jitattn version" if other else "")
          + (f", {bad - unfixed} removed" if args.fix else
             (f" (--fix removes {'them' if not permission else f'{bad - permission} of them'})"
              if bad > permission else ""))
          + (f"; {permission} of them need a permission fix (above), not a removal" if permission else "")
          + (f"; {len(unsafe)} unsafe path(s): jitattn refuses to build in or load from them until fixed"
             if unsafe else ""))
    return EXIT_FAILED if unfixed or unsafe else EXIT_OK


# -- maintain ----------------------------------------------------------------------------


def _not_writable(exc: OSError, base: Path, progress: str) -> int:
    """Report a removal that the filesystem refused (a read-only cache) and return the exit code."""
    import errno

    path = exc.filename or base
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        print(f"jitattn-cache: cannot change {path}: {exc.strerror}. The cache at {base.parent} is read-only for "
              f"you, so nothing can be removed from it ({progress}). Run this as the user who owns it, make it "
              "writable, or point JITATTN_CACHE_DIR at your own cache (a shared read-only cache belongs in "
              "JITATTN_CACHE_PATH)", file=sys.stderr)
    else:
        fix = f"; it is in the cache's way: remove it (rm -rf {path}) and retry" if exc.errno == errno.EISDIR else ""
        print(f"jitattn-cache: cannot change {path}: {exc.strerror or exc} ({progress}){fix}", file=sys.stderr)
    return EXIT_FAILED


def _unusable_base(base: Path) -> str | None:
    """Why the writable schema dir ``base`` cannot be used, with its fix; None when it can (or does not exist yet). A
    file there holds no entries; a link, which loads refuse, would have clear or prune delete where it points."""
    if base.is_symlink():
        return (f"{base} is a symbolic link (to {os.path.realpath(base)}), which jitattn never loads from: the "
                f"writable cache cannot be used; replace the link with a directory (rm {base}) or point "
                "JITATTN_CACHE_DIR at the real cache")
    if base.exists() and not base.is_dir():
        return (f"{base} is in the jitattn cache's way: it exists but is not a directory, so the writable cache "
                f"cannot be used; remove it (rm {base}) or set JITATTN_CACHE_DIR to another directory")
    return None


def _refuse_unusable_base(base: Path) -> bool:
    """Whether ``base`` cannot be used (said so, with nothing removed): clear and prune stop there."""
    problem = _unusable_base(base)
    if problem:
        print(f"jitattn-cache: {problem}; nothing removed", file=sys.stderr)
    return problem is not None


def cmd_clear(args: argparse.Namespace) -> int:
    """Remove every entry (and kept failed builds, and what killed builds left) of the writable cache, each under
    its lock."""
    from jitattn.jit.admin import remove_entry, remove_stale_builds

    from .bundle import remove_stale_imports
    from .store import entries, writable_base

    base = writable_base()
    if _refuse_unusable_base(base):  # (a file holds no entries: "removed 0" would read as done)
        return EXIT_FAILED
    removed, busy = 0, []
    try:
        for e in entries(include_readonly=False):
            if remove_entry(e.base, e.path):
                removed += 1
            else:
                busy.append(e.name)
        if (base / "failed").exists():
            shutil.rmtree(base / "failed")
        leftovers = remove_stale_builds(base) + remove_stale_imports(base)
    except OSError as exc:
        return _not_writable(exc, base, f"removed {removed} entries before that")
    print(f"cleared {base}: removed {removed} entries"
          + (f" and {leftovers} directories that killed builds or imports left" if leftovers else ""))
    for name in busy:
        print(f"  kept {name}: a build of it is running (its lock is held)", file=sys.stderr)
    return EXIT_FAILED if busy else EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    """Remove entries of the writable cache by build time (oldest first), never touching the load path."""
    from jitattn.jit.admin import remove_entry

    from .store import entries, human_size, parse_duration, parse_size, writable_base

    if args.max_size is None and args.older_than is None:
        raise UsageError("prune needs --max-size SIZE (e.g. 2G) and/or --older-than AGE (e.g. 30d)")
    if _refuse_unusable_base(writable_base()):
        return EXIT_FAILED
    max_size = parse_size(args.max_size) if args.max_size is not None else None
    max_age = parse_duration(args.older_than) if args.older_than is not None else None
    epoch = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    every = entries(include_readonly=False)
    rows = [e for e in every if e.manifest is not None]  # an entry without a readable manifest is verify's to fix
    rows.sort(key=lambda e: (e.built_at or epoch, e.name))  # unknown build time: oldest
    sizes = {e.name: e.size for e in rows}
    now = datetime.datetime.now(datetime.timezone.utc)
    doomed: dict[str, object] = {}  # name -> entry, oldest first
    if max_age is not None:
        doomed = {e.name: e for e in rows if e.built_at is None or now - e.built_at > max_age}
    if max_size is not None:
        total = sum(sizes[e.name] for e in rows if e.name not in doomed)
        for e in rows:
            if total <= max_size:
                break
            if e.name not in doomed:
                doomed[e.name] = e
                total -= sizes[e.name]
    doomed = sorted(doomed.values(), key=rows.index)
    freed, busy = 0, []
    for e in doomed:
        age = f"built {e.built_at:%Y-%m-%d %H:%M}" if e.built_at else "build time unknown"
        if args.dry_run:
            print(f"would remove {e.uri} ({human_size(sizes[e.name])}, {age})")
            freed += sizes[e.name]
        else:
            try:
                gone = remove_entry(e.base, e.path)
            except OSError as exc:
                return _not_writable(exc, e.base, f"removed {human_size(freed)} before that")
            if gone:
                print(f"removed {e.uri} ({human_size(sizes[e.name])}, {age})")
                freed += sizes[e.name]
                continue
            busy.append(e)
            print(f"kept {e.uri}: a build of it is running (its lock is held)", file=sys.stderr)
    removed = len(doomed) - len(busy)
    left = sum(sizes.values()) - freed
    verb = "would prune" if args.dry_run else "pruned"
    print(f"{verb} {removed} entries ({human_size(freed)}); {len(rows) - removed} entries, {human_size(left)} left "
          f"in {writable_base()}")
    unreadable = [e for e in every if e.manifest is None]
    if unreadable:
        print(f"not counted: {len(unreadable)} entries without a readable manifest "
              f"({human_size(sum(e.size for e in unreadable))}); `jitattn-cache verify --fix` removes them",
              file=sys.stderr)
    return EXIT_FAILED if busy else EXIT_OK


def cmd_presets(args: argparse.Namespace) -> int:
    from .presets import PRESETS

    width = max(map(len, PRESETS)) + 2
    for name, shape in PRESETS.items():
        print(f"{name:{width}s} {shape.describe()}")
    return EXIT_OK


# -- parser --------------------------------------------------------------------------------


def _warm(args):
    from .warm import cmd_warm

    return cmd_warm(args)


def _export(args):
    from .bundle import cmd_export

    return cmd_export(args)


def _import(args):
    from .bundle import cmd_import

    return cmd_import(args)


def _doctor(args):
    from .doctor import cmd_doctor

    return cmd_doctor(args)


def _show_config(args):
    from .doctor import cmd_show_config

    return cmd_show_config(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jitattn-cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from jitattn import __version__

    parser.add_argument("--version", action="version", version=f"jitattn-cache (jitattn) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    warm = sub.add_parser("warm", help="pre-build every kernel a model (or spec) needs",
                          description="Build every spec a model's decode, prefill (paged and ragged), cascade, "
                                      "merge and append paths request, in parallel, with progress.")
    add_selection_args(warm)
    warm.add_argument("-j", "--jobs", type=int, help="parallel compiles (default: min(CPUs, free memory / 2 GiB), "
                                                     "or JITATTN_MAX_JOBS / MAX_JOBS)")
    warm.add_argument("--dry-run", action="store_true", help="list the specs and their cache status; build nothing")
    warm.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    warm.set_defaults(func=_warm)

    ls = sub.add_parser("ls", aliases=["list"], help="list cache entries (uri, target, arch, size, build time, layer)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_ls)

    info = sub.add_parser("info", help="show one entry: status and manifest")
    info.add_argument("uri", help="a uri, an entry dir name or a key prefix (6+ hex digits)")
    info.set_defaults(func=cmd_info)

    verify = sub.add_parser("verify", help="re-checksum every entry of every layer")
    verify.add_argument("--fix", action="store_true", help="remove bad entries (writable cache only)")
    verify.set_defaults(func=cmd_verify)

    clear = sub.add_parser("clear", help="remove every entry of the writable cache")
    clear.set_defaults(func=cmd_clear)

    prune = sub.add_parser("prune", help="remove old entries of the writable cache (by build time, oldest first)")
    prune.add_argument("--max-size", metavar="SIZE", help="keep the newest entries that fit, e.g. 2G, 500M")
    prune.add_argument("--older-than", metavar="AGE", help="remove entries built longer ago, e.g. 30d, 12h, 2w")
    prune.add_argument("--dry-run", action="store_true", help="print what would be removed")
    prune.set_defaults(func=cmd_prune)

    export = sub.add_parser("export", help="write cache entries to a bundle (.tar.gz) for other machines",
                            description="Bundle entries of the writable cache and the read-only layers: all of "
                                        "them, or those a --preset / --config / --spec selection needs.")
    export.add_argument("file", metavar="FILE.tar.gz")
    add_selection_args(export)
    export.add_argument("--allow-missing", action="store_true",
                        help="export what is there when some selected specs are not cached (default: refuse)")
    export.set_defaults(func=_export)

    imp = sub.add_parser("import", help="add a bundle's entries to a cache (checked, atomic)")
    imp.add_argument("file", metavar="FILE.tar.gz")
    imp.add_argument("--to", metavar="DIR", help="cache root to import into (default: the writable cache); "
                                                 "use DIR read-only with JITATTN_CACHE_PATH=DIR")
    imp.add_argument("--force", action="store_true",
                     help="import entries built for another CUDA arch list (never skips the safety checks)")
    imp.set_defaults(func=_import)

    show = sub.add_parser("show-config", help="print every jitattn setting, its value and where it came from")
    show.set_defaults(func=_show_config)

    doctor = sub.add_parser("doctor", help="check the toolchain, GPU, cache dir and layers; say how to fix problems")
    doctor.set_defaults(func=_doctor)

    presets = sub.add_parser("presets", help="list the model presets")
    presets.set_defaults(func=cmd_presets)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    from jitattn import env
    from jitattn.jit import JitError, ToolchainError

    # every command touching the cache refuses a bad cache dir setting the same way (exit 2) before it starts
    uses_cache = args.command not in _REPORTS_SETTINGS and not (args.command == "import" and args.to is not None)
    if uses_cache and (problem := env.CACHE_DIR.problem()):
        print(f"jitattn-cache: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with _stopped_as_by_ctrl_c():
            return args.func(args)
    except BrokenPipeError:  # the reader stopped reading (`| head`): what it took was printed, the work is done
        _quiet_closed_stdout()
        return EXIT_OK
    except UsageError as exc:
        print(f"jitattn-cache: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:  # a bad setting (e.g. MAX_JOBS=abc) found while running
        print(f"jitattn-cache: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (JitError, ToolchainError, OSError) as exc:
        print(f"jitattn-cache: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("\njitattn-cache: interrupted; the cache is consistent (nothing half-built is published)",
              file=sys.stderr)
        return EXIT_INTERRUPTED


# Commands that report the settings themselves (each problem found: exit 1) or read no cache (import --to DIR
# writes into DIR alone).
_REPORTS_SETTINGS = frozenset({"show-config", "doctor", "presets"})


def _quiet_closed_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not report the closed pipe again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def _stopped_as_by_ctrl_c():
    """SIGTERM and SIGHUP (``kill``, a closed terminal) stop a command as Ctrl-C does: the running compilers are
    killed and nothing half-built is published (by default the process would end and leave ninja compiling)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = {number: signal.signal(number, interrupt) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


if __name__ == "__main__":
    sys.exit(main())
