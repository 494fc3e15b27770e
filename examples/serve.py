"""Serve a synthetic workload with jitattn's serving engine and print what a serving engineer measures.

Requests arrive as a Poisson process, all starting with one shared system prompt followed by a
prompt of their own; the engine prefills them in chunks, shares the system prompt's KV pages
through its radix tree, and decodes the running batch with cascade (or flat) attention. It
prints output tokens/s, time to first token (TTFT), time per output token (TPOT) and the KV
memory that sharing saved.

    python3 examples/serve.py                                    # tiny random model, cpu, seconds
    python3 examples/serve.py --device cuda --model llama-3-8b-shapes --graphs --num-requests 64
    torchrun --nproc-per-node 2 examples/serve.py --tp 2         # tensor parallel (gloo on cpu, nccl on cuda)
    python3 examples/serve.py --model /path/to/hf-llama-checkpoint

Before serving a new model, pre-build its kernels so no rank compiles at start-up:
``jitattn-cache warm --config <model>/config.json --tp N --dtype bfloat16`` (``--target cpu
--dtype float32`` for the cpu runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def count(low: int):
    """An argparse type: an int >= ``low``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    parse.__name__ = f"int >= {low}"
    return parse


def seed(text: str) -> int:
    """An argparse type: an int in [0, 2^63) (torch's generator takes a 64-bit seed)."""
    value = int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 2^63)")
    return value


def rate(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return value


def ints(low: int):
    """An argparse type: comma-separated ints >= ``low``."""
    def parse(text: str) -> list[int]:
        return [count(low)(part) for part in text.split(",")]
    parse.__name__ = f"comma-separated ints >= {low}"
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="cpu, cuda or auto (cuda when "
                   "visible)")
    p.add_argument("--model", default="tiny", help="tiny, small, llama-3-8b-shapes, or a checkpoint directory")
    p.add_argument("--layers", type=count(1), help="override the preset's layer count")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="float32 (default on cpu) or bfloat16 (default on cuda)")
    p.add_argument("--num-requests", type=count(1), default=16)
    p.add_argument("--rate", type=rate, default=0.0, help="arrivals per second (0: all at once)")
    p.add_argument("--system-prompt-len", type=count(0), default=64, help="tokens every prompt starts with")
    p.add_argument("--prompt-len", type=count(1), default=24, help="mean own prompt tokens per request (uniform in "
                   "[mean / 2, mean * 3 / 2])")
    p.add_argument("--prompt-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="own prompt tokens uniform in [MIN, MAX] instead")
    p.add_argument("--branches", type=int, default=0,
                   help="a prefix tree: after the system prompt, request i continues with branch i %% N's block "
                   "(an agent's fork; 0: none)")
    p.add_argument("--branch-len", type=int, default=0, help="tokens of each branch's block")
    p.add_argument("--output-len", type=count(1), default=16, help="mean output tokens per request")
    p.add_argument("--cascade", action=argparse.BooleanOptionalAction, default=True,
                   help="cascade attention for requests sharing prefix pages (default on)")
    p.add_argument("--cascade-depth", type=count(1), help="at most this many shared levels per cascade step (default: "
                   "the prefix tree's depth on the cpu, its cheapest cut on cuda; 1: one node per prefix group, the "
                   "two-level cascade)")
    p.add_argument("--graphs", action="store_true",
                   help="replay CUDA graphs of the decode step, flat and cascade (cuda)")
    p.add_argument("--tp", type=count(1), default=1, help="tensor-parallel degree (launch with torchrun)")
    p.add_argument("--page-size", type=count(1), default=16)
    p.add_argument("--num-pages", type=count(2), help="KV pool pages, one of them the engine's scratch page (default: "
                   "room for every request at once without prefix sharing, capped by --kv-memory-fraction)")
    p.add_argument("--kv-memory-fraction", type=fraction, default=0.85,
                   help="cuda: the KV pool's share of the GPU memory free once the model is loaded (default 0.85)")
    p.add_argument("--max-batch-size", type=count(1), default=64)
    p.add_argument("--chunk", type=count(1), default=512, help="prefill tokens per step")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


def setup_parallel(args: argparse.Namespace, device: str):
    """The engine's TP group; under torchrun, the default process group (gloo on cpu, nccl on cuda)."""
    from jitattn.serving import TPGroup

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp != world:
        sys.exit(f"--tp {args.tp} needs {args.tp} processes; launch with torchrun --nproc-per-node {args.tp} "
                 f"(this is {world})")
    if args.tp == 1:
        return TPGroup(), device
    import torch.distributed as dist

    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return TPGroup(dist.get_rank(), dist.get_world_size()), device


_HOST_BYTES_PER_TOKEN = 40  # a prompt token as a Python int in a list (its object and the list's pointer)


def _host_memory() -> int:
    """This host's physical memory in bytes (64 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 64 << 30


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt, output tokens) per request: the same on every rank (seeded)."""
    if args.branches < 0 or (args.branches and args.branch_len < 1):
        sys.exit("--branches N needs N >= 0 and, with N > 0, --branch-len >= 1")
    low, high = args.prompt_len_range or (args.prompt_len // 2, args.prompt_len * 3 // 2)
    if not 0 <= low <= high or high < 1:
        sys.exit(f"--prompt-len-range {low} {high}: need 0 <= MIN <= MAX and MAX >= 1 (a prompt has a token of its "
                 "own)")
    longest = args.system_prompt_len + (args.branch_len if args.branches else 0) + max(1, high)
    if args.num_requests * longest * _HOST_BYTES_PER_TOKEN > _host_memory() // 2:  # before any list is built
        sys.exit(f"the workload's prompts ({args.num_requests} requests of up to {longest} tokens: system prompt, "
                 "branch and own prompt) would not fit in half this host's memory as token lists; give fewer "
                 "(--num-requests) or shorter (--system-prompt-len, --prompt-len) requests")
    gen = torch.Generator().manual_seed(args.seed)
    system = torch.randint(0, vocab, (args.system_prompt_len,), generator=gen).tolist()
    blocks = [torch.randint(0, vocab, (args.branch_len,), generator=gen).tolist() for _ in range(args.branches)]
    requests, arrival = [], 0.0
    for i in range(args.num_requests):
        if args.rate > 0:
            arrival += float(torch.empty(1).exponential_(args.rate, generator=gen))
        own = max(1, int(torch.randint(low, high + 1, (1,), generator=gen)))
        out = max(1, int(torch.randint(args.output_len // 2, args.output_len * 3 // 2 + 1, (1,), generator=gen)))
        prefix = system + (blocks[i % args.branches] if args.branches else [])
        requests.append((arrival, prefix + torch.randint(0, vocab, (own,), generator=gen).tolist(), out))
    if arrival > 86400:  # the engine refuses arrivals more than a day ahead of its clock
        sys.exit(f"--rate {args.rate:g}: the {args.num_requests} arrivals would span {arrival:.3g} s, over a day; "
                 "give a higher rate (or 0: all at once)")
    return requests


def unwritable(flag: str, path: str) -> str | None:
    """Why ``path`` cannot be written as a file (None when it can): checked before a run, not after it."""
    if not path.strip():
        return f"{flag}: the path is empty; name a file"
    target = Path(path)
    if target.is_dir():
        return f"{flag} {path}: is a directory; give a file name"
    if target.exists() and not target.is_file():  # a FIFO would block the trial open below
        return f"{flag} {path}: is not a regular file; give a file name"
    if not target.resolve().parent.exists():
        return f"{flag} {path}: {target.resolve().parent} does not exist; create it (mkdir -p) or name another file"
    if not target.resolve().parent.is_dir():
        return f"{flag} {path}: {target.resolve().parent} is not a directory"
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        return f"{flag} {path}: cannot be written ({exc.strerror})"
    if not existed:
        target.unlink()
    return None


def default_num_pages(args: argparse.Namespace, model, pages_per_request: int, device: str) -> int:
    """Room for every request of a batch at once as if nothing were shared, capped on cuda by what
    ``--kv-memory-fraction`` of the free GPU memory holds (prefix sharing makes the cap enough: the
    radix tree evicts idle prefixes when the pool is full)."""
    from jitattn.serving import pages_in_budget

    unshared = pages_per_request * min(args.num_requests, args.max_batch_size) + 2
    if not device.startswith("cuda"):
        return unshared
    torch.cuda.empty_cache()  # memory an earlier run in this process freed goes back to the device first
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    c = model.config
    fit = pages_in_budget(free * args.kv_memory_fraction, c.num_hidden_layers, args.page_size, model.num_kv_heads,
                          c.head_dim, model.dtype)
    if fit < pages_per_request + 2:
        raise SystemExit(f"{args.kv_memory_fraction:.0%} of the free GPU memory ({free / 2**30:.1f} GiB) holds {fit} "
                         f"KV pages, fewer than one request needs ({pages_per_request}); raise --kv-memory-fraction "
                         "or shorten the requests")
    return min(unshared, fit)


def main(argv: list[str] | None = None) -> dict:
    from tqdm import tqdm

    from jitattn.serving import Engine, LlamaModel, load_checkpoint, preset

    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is visible here (use --device cpu or auto)")
    if args.graphs and device != "cuda":
        sys.exit(f"--graphs replays CUDA graphs of the decode step: it needs --device cuda (this run is on {device})")
    if args.json is not None and (problem := unwritable("--json", args.json)):
        sys.exit(problem)
    group, device = setup_parallel(args, device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if Path(args.model).is_dir():
        if args.layers is not None:
            sys.exit(f"--layers {args.layers}: it overrides a preset's layer count; the checkpoint {args.model} has "
                     "its own")
        config, weights = load_checkpoint(args.model)
        model = LlamaModel(config, weights, dtype=dtype, device=device, group=group)
    else:
        config = preset(args.model)
        if args.layers is not None:
            config = config.with_layers(args.layers)
        model = LlamaModel.random(config, seed=args.seed, dtype=dtype, device=device, group=group)
    work = workload(args, config.vocab_size)
    longest = max(len(p) + n for _, p, n in work)
    pages_per_request = -(-longest // args.page_size)
    num_pages = args.num_pages or default_num_pages(args, model, pages_per_request, device)
    try:
        engine = Engine(model, num_pages=num_pages, page_size=args.page_size, max_batch_size=args.max_batch_size,
                        prefill_chunk_tokens=args.chunk, cascade=args.cascade, cuda_graphs=args.graphs,
                        cascade_depth=args.cascade_depth, max_seq_len=longest + 1)
    except (torch.OutOfMemoryError, RuntimeError) as exc:  # the pool's one allocation (the CPU's says "allocate")
        if not isinstance(exc, torch.OutOfMemoryError) and "allocate" not in str(exc):
            raise
        if args.num_pages:
            sys.exit(f"--num-pages {num_pages}: a KV pool of {num_pages} pages does not fit in {device}'s memory; "
                     "give fewer pages")
        sys.exit(f"the KV pool these requests need ({num_pages} pages of {args.page_size} tokens: up to "
                 f"{min(args.num_requests, args.max_batch_size)} requests of up to {longest} tokens at once) does not "
                 f"fit in {device}'s memory; give fewer or shorter requests (--output-len, --prompt-len), a smaller "
                 "--max-batch-size or --page-size, or --num-pages")
    leader = group.rank == 0
    if args.graphs:  # at startup, as serving engines do: the timed run replays them
        capture_started = time.perf_counter()
        captured = engine.capture_graphs()
        if leader:
            print(f"captured {captured} decode graphs in {time.perf_counter() - capture_started:.1f} s")
    requests = [engine.add_request(prompt, n, arrival) for arrival, prompt, n in work]
    bar = tqdm(total=len(requests), unit="req", desc="serving", disable=not leader, file=sys.stderr)
    started = time.perf_counter()
    engine.run(on_finish=lambda _: bar.update(1))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    bar.close()
    served = [r for r in requests if r.error is None]  # a request given up (its prefill raised) is in engine.failed
    if not served:
        raise SystemExit(f"every request failed; the first: {engine.failed[0].error}")
    ttft = [r.first_token_time - r.arrival for r in served]
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in served if len(r.output) > 1]
    s = engine.stats
    results = {
        "model": args.model, "layers": config.num_hidden_layers, "device": device, "dtype": str(dtype).split(".")[-1],
        "tp": group.size, "cascade": args.cascade, "cascade_depth": args.cascade_depth, "graphs": args.graphs,
        "requests": len(requests), "failed_requests": len(engine.failed),
        "wall_s": wall, "output_tokens_per_s": s.generated_tokens / wall,
        "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p99_ms": 1e3 * sorted(ttft)[math.ceil(0.99 * len(ttft)) - 1],
        "tpot_mean_ms": 1e3 * statistics.mean(tpot) if tpot else None,
        "prompt_tokens_reused": s.reused_prompt_tokens, "prompt_tokens_computed": s.prefill_tokens,
        "kv_bytes_saved_peak": s.peak_bytes_saved, "kv_pages_saved_peak": s.peak_pages_saved,
        "kv_bytes_per_page": engine.pool.bytes_per_page, "decode_steps": s.decode_steps,
        "cascade_steps": s.cascade_steps, "graph_steps": s.graph_steps, "evicted_pages": s.evicted_pages,
        "kv_pool_pages": num_pages, "max_cascade_levels": s.max_cascade_levels,
        "decode_s": s.decode_seconds, "decode_kv_tokens": s.decode_kv_tokens, "decode_tokens": s.decode_tokens,
        "decode_pairs": s.decode_pairs, "attention_flops_per_pair": engine.costs.flops_per_pair,
        "weight_bytes": model.weight_bytes, "kv_bytes_per_token": engine.pool.bytes_per_page // args.page_size,
    }
    if leader:
        print(f"{len(requests)} requests on {device} (tp {group.size}, cascade {'on' if args.cascade else 'off'}, "
              f"graphs {'on' if args.graphs else 'off'}), {config.num_hidden_layers} layers, {results['dtype']}")
        if engine.failed:
            print(f"  FAILED            {len(engine.failed)} requests; the first: {engine.failed[0].error}")
        print(f"  output tokens/s   {results['output_tokens_per_s']:.1f} ({s.generated_tokens} tokens in {wall:.2f} s)")
        print(f"  TTFT              mean {results['ttft_mean_ms']:.1f} ms, p99 {results['ttft_p99_ms']:.1f} ms")
        if tpot:
            print(f"  TPOT              mean {results['tpot_mean_ms']:.2f} ms")
        print(f"  prefix sharing    {s.reused_prompt_tokens} prompt tokens reused, {s.prefill_tokens} computed; "
              f"KV saved at peak {s.peak_bytes_saved / 2**20:.2f} MiB ({s.peak_pages_saved} pages"
              + (" per rank" if group.size > 1 else "") + ")")
        print(f"  decode steps      {s.decode_steps} ({s.cascade_steps} cascade, {s.graph_steps} graph replays; "
              f"a captured cascade step counts in both; deepest cascade {s.max_cascade_levels} levels)")
        print(f"  KV pool           {num_pages} pages of {args.page_size} tokens, {s.evicted_pages} evicted")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if group.size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:  # the library's own refusals (a flag it cannot take): the message, not a traceback
        sys.exit(f"serve.py: {exc}")
