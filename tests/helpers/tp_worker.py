"""Rank functions for the tensor-parallel tests, run by ``torch.multiprocessing.spawn`` (gloo, file init)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _init(rank: int, world: int, init_file: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _end(dist) -> None:
    """Leave the group together, then exit without the interpreter's finalisation.

    A spawned rank otherwise leaves through ``sys.exit``, whose teardown of C++ statics met a still-joinable
    gloo thread now and then ("terminate called without an active exception", SIGABRT) after every result had
    been written. ``os._exit`` is how a forked multiprocessing child leaves too.
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _loaded_specs() -> list[str]:
    import jitattn.jit

    return sorted(spec.uri for spec, _ in jitattn.jit._registry)


def serve(rank: int, world: int, init_file: str, env: dict[str, str], config: dict, prompts: list[list[int]],
          new_tokens: int, out_dir: str) -> None:
    """Serve ``prompts`` on this rank's shard; write its tokens, compile count and loaded specs."""
    _init(rank, world, init_file, env)
    import torch.distributed as dist

    import jitattn.jit
    from jitattn.serving import Engine, LlamaModel, ModelConfig, TPGroup

    model = LlamaModel.random(ModelConfig(**config), seed=0, group=TPGroup(rank, world))
    engine = Engine(model, num_pages=64, page_size=8)
    requests = [engine.add_request(p, new_tokens) for p in prompts]
    engine.run()
    result = dict(tokens=[r.output for r in requests], compiles=jitattn.jit.compile_count(),
                  loaded=_loaded_specs(), heads=[model.num_q_heads, model.num_kv_heads],
                  cascade_steps=engine.stats.cascade_steps)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    _end(dist)


def race_load(rank: int, world: int, init_file: str, env: dict[str, str], spec: dict, out_dir: str) -> None:
    """Every rank loads the same cold spec at once (after a barrier); write this rank's compile count."""
    _init(rank, world, init_file, env)
    import torch.distributed as dist

    import jitattn.jit
    from jitattn.spec import VariantSpec

    dist.barrier()
    jitattn.jit.load(VariantSpec.from_dict(spec))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(dict(compiles=jitattn.jit.compile_count())))
    _end(dist)


def serve_teacher_forced(rank: int, world: int, init_file: str, env: dict[str, str], config: dict,
                         prompts: list[list[int]], forced: list[list[int]], new_tokens: int, out_dir: str) -> None:
    """On GPU ``rank`` (NCCL): serve ``prompts`` with teacher forcing; rank 0 saves the logits and its timing."""
    os.environ.update(env)
    import time

    import torch
    import torch.distributed as dist

    import jitattn.jit
    from jitattn.serving import Engine, LlamaModel, ModelConfig, TPGroup

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = LlamaModel.random(ModelConfig(**config), seed=0, dtype=torch.bfloat16, device=f"cuda:{rank}",
                              group=TPGroup(rank, world))
    engine = Engine(model, num_pages=64 * 12 + 64, page_size=16)
    requests = [engine.add_request(p, new_tokens, forced_tokens=f, keep_logits=True) for p, f in zip(prompts, forced)]
    started = time.perf_counter()
    engine.run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    compiles = torch.tensor([jitattn.jit.compile_count()], device=f"cuda:{rank}")
    dist.all_reduce(compiles)
    if rank == 0:
        torch.save(dict(logits=[torch.stack(r.logits) for r in requests], seconds=seconds,
                        tokens=engine.stats.generated_tokens, compiles=int(compiles)), Path(out_dir, "rank0.pt"))
    _end(dist)
