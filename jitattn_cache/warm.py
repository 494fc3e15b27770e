"""``jitattn-cache warm``: build every selected spec in parallel, with progress and a summary.

Builds run on a pool of ``-j`` threads, each running one spec's ``build_many``
with one compiler job, so at most ``-j`` compilers run at once (the same
budget ``build_many`` applies). The pool is ours, not ``build_many``'s, for
two reasons: the progress bar shows what is being built right now, and
Ctrl-C cancels the queued specs instead of draining the queue. An
interrupted build never publishes anything (builds happen in a private temp
dir and are published by one rename), so the cache stays consistent.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from .selection import UsageError, arch_env, resolve_specs

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _status(spec) -> tuple[str, str]:
    """('cached' | 'cold' | 'unavailable', detail) without building anything."""
    from jitattn.jit import JitError, ToolchainError
    from jitattn.jit.admin import find_entry
    from jitattn.jit.admin import build_inputs

    try:
        plan = build_inputs(spec)
    except (NotImplementedError, ValueError, ToolchainError, JitError) as exc:
        return "unavailable", str(exc).splitlines()[0]
    try:
        entry = find_entry(plan)
    except JitError as exc:
        return "error", str(exc).splitlines()[0]
    if entry is not None:
        return "cached", str(entry)
    return "cold", plan.name


def _targets(specs: list) -> str:
    return "/".join(sorted({s.target.value for s in specs}))


def dry_run(specs: list) -> int:
    """List each spec's cache status; exit 1 where some spec is unavailable or its lookup fails (as the warm would)."""
    counts: dict[str, int] = {}
    width = max(len(s.uri) for s in specs) + 2
    for spec in specs:
        status, detail = _status(spec)
        counts[status] = counts.get(status, 0) + 1
        print(f"{spec.uri:{width}s} {status:12s} {detail}")
    summary = ", ".join(f"{n} {status}" for status, n in counts.items())
    print(f"{len(specs)} specs (target {_targets(specs)}): {summary}")
    # exit as the warm would: a spec that cannot be built (or looked up) fails it
    return EXIT_FAILED if counts.get("unavailable") or counts.get("error") else EXIT_OK


def _short_error(error: str | None, lines: int = 12) -> str:
    text = (error or "unknown error").strip().splitlines()
    if len(text) > lines:
        text = text[: lines // 2] + [f"... ({len(text) - lines} more lines) ..."] + text[-lines // 2:]
    return "\n".join("    " + line for line in text)


def build_with_progress(specs: list, jobs: int, quiet: bool = False):
    """(results in spec order, interrupted) after building ``specs`` on ``jobs`` threads."""
    import jitattn.jit as jit
    from jitattn.jit.admin import reset_cancel
    from tqdm import tqdm

    reset_cancel()
    stop = threading.Event()
    running: dict = {}  # spec -> start time, in start order
    lock = threading.Lock()
    results: dict = {}

    def one(spec):
        if stop.is_set():
            return None
        with lock:
            running[spec] = time.perf_counter()
        started = time.perf_counter()
        try:
            return jit.build_many([spec], jobs=1)[0]
        except Exception as exc:  # noqa: BLE001 - anything unexpected is this spec's failure, not the run's
            return jit.BuildResult(spec, "failed", time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
        finally:
            with lock:
                running.pop(spec, None)

    bar = tqdm(total=len(specs), unit="spec", desc="jitattn warm", disable=quiet, file=sys.stderr,
               dynamic_ncols=True, bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}")
    shown = [""]

    def show_running() -> None:
        with lock:
            now = [s.uri for s in running]
        text = f"building {now[-1]}" + (f" (+{len(now) - 1})" if len(now) > 1 else "") if now else ""
        if text != shown[0]:
            shown[0] = text
            bar.set_postfix_str(text, refresh=True)

    interrupted = False
    pool = ThreadPoolExecutor(max_workers=max(1, min(jobs, len(specs))), thread_name_prefix="jitattn-warm")
    futures: dict[Future, object] = {pool.submit(one, spec): spec for spec in specs}
    pending = set(futures)
    try:
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                result = future.result()
                results[futures[future]] = result
                bar.update(1)
                if result is not None and result.status == "failed":
                    first = ((result.error or "").strip().splitlines() or ["unknown error"])[0]
                    bar.write(f"FAILED {result.spec.uri}: {first}", file=sys.stderr)
            show_running()
        pool.shutdown(wait=True)
    except KeyboardInterrupt:
        interrupted = True
        stop.set()
        _stop_and_collect(pool, futures, results)
    finally:
        bar.close()
    return [results.get(spec) for spec in specs], interrupted


def _stop_and_collect(pool: ThreadPoolExecutor, futures: dict, results: dict) -> None:
    """After a Ctrl-C: kill the running compilers (their builds publish nothing), then keep in ``results`` what
    finished meanwhile, waiting under a second."""
    from jitattn.jit.admin import cancel_builds

    stopped = cancel_builds()
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"\njitattn-cache: interrupted; stopped {stopped} running compile(s) (nothing half-built is "
          "published)", file=sys.stderr)
    # The workers notice within a fraction of a second (their compiler is gone, lock waits poll);
    # collect what finished, but never wait long: the point of Ctrl-C is to stop.
    deadline = time.monotonic() + 0.8
    try:
        for future in futures:
            left = deadline - time.monotonic()
            if future.cancelled() or left <= 0:
                continue
            try:
                result = future.result(timeout=left)
            except Exception:  # noqa: BLE001 - it was interrupted; the cache is what matters
                continue
            if result is not None and result.status != "failed":
                results[futures[future]] = result
    except KeyboardInterrupt:
        pass


def cmd_warm(args: argparse.Namespace) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"-j {args.jobs} must be at least 1")
    with arch_env(args.arch):
        specs = resolve_specs(args)
        if args.arch and args.target == "cpu" and all(s.target.value == "cpu" for s in specs):
            print("jitattn-cache: note: --arch only applies to the cuda target", file=sys.stderr)
        if args.dry_run:
            return dry_run(specs)
        from jitattn import env
        from jitattn.jit.admin import default_jobs

        problem = env.CACHE_DIR.problem()
        if problem is not None:  # once, not as every spec's failed build
            raise UsageError(problem)

        jobs = args.jobs or default_jobs()
        started = time.perf_counter()
        results, interrupted = build_with_progress(specs, jobs, quiet=args.quiet)
    elapsed = time.perf_counter() - started
    done = [r for r in results if r is not None]
    built = [r for r in done if r.status == "built"]
    by_other = [r for r in done if r.status == "built-by-other"]
    cached = [r for r in done if r.status == "cached"]
    failed = [r for r in done if r.status == "failed"]
    if interrupted:
        missing = len(specs) - len(built) - len(by_other) - len(cached)
        print(f"jitattn-cache warm: interrupted after {elapsed:.1f} s: {len(built)} built, {len(by_other)} built by "
              f"another process, {len(cached)} already cached, {missing} not built. The cache is consistent; run "
              "the same command again to finish.", file=sys.stderr)
        return EXIT_INTERRUPTED
    other = f", {len(by_other)} built by another process meanwhile" if by_other else ""
    print(f"jitattn-cache warm: {len(built)} built{other}, {len(cached)} already cached, {len(failed)} failed "
          f"({len(specs)} specs, target {_targets(specs)}, -j {jobs}, {elapsed:.1f} s)")
    if failed:
        print(f"\n{len(failed)} build(s) failed:", file=sys.stderr)
        for r in failed:
            print(f"  {r.spec.uri}:\n{_short_error(r.error)}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK
