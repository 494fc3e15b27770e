"""The cascade rows: a shared prefix (or a three-level tree) as a cascade, beside flat decode over the same pages
and, for a tree, beside its two-level cascade.

Rates are over the tree's bytes (every node once), so the flat and two-level rows read as fractions of the
cascade's ideal. Each row's error is checked against ``jitattn.reference`` on the first requests and the last
(another branch of a tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .configs import Cascade
from .inputs import AttnData, PageTable, check_prebuilt, jitattn_fn, pool_pages, random_tensor, seed_of
from .rows import REF_REQUESTS, TORCH_DTYPES, BudgetExceeded, Context, join_notes, new_row, rel_err, set_time
from .sdpa import run_sdpa, sdpa_groups


@dataclass
class _Tree:
    """One case's data: the KV pool, the queries, each level's plan arrays, the flat page table."""

    cache: torch.Tensor
    q: torch.Tensor
    levels: list[tuple]  # per level: (qo_indptr, kv_indptr, kv_indices, last_page_len)
    two_levels: list[tuple] | None  # a tree's two-level twin (root + branch one node per branch)
    flat: PageTable


def run_cascade(case: Cascade, ctx: Context) -> list[dict]:
    import jitattn

    row, flat_case = new_row(case), case.flat()
    flat_row = dict(new_row(flat_case), suite="cascade",
                    note="flat paged decode over the same page table (shared pages listed per request; L2 serves "
                         "repeats)")
    two_row = None
    if case.branches:
        two_row = new_row(case, case.name + ":two_level")
        two_row["note"] = "two levels: each branch's requests share root + branch as one node (the root read per branch)"
    try:
        check_prebuilt(case, ctx.target, ctx.failed_specs)
        tree = _tree(case, ctx)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=ctx.device)

        def cascade_fn(levels):
            wrapper = jitattn.MultiLevelCascadeAttentionWrapper(len(levels), workspace, kv_layout="NHD")
            wrapper.plan(*[list(arrays) for arrays in zip(*levels)], case.num_qo_heads, case.num_kv_heads,
                         case.head_dim, case.page_size, causal=False, q_data_type=TORCH_DTYPES[case.dtype])
            return lambda: wrapper.run(tree.q, tree.cache)

        fn = cascade_fn(tree.levels)
        two_fn = cascade_fn(tree.two_levels) if tree.two_levels else None
        flat_data = AttnData(flat_case, tree.q, torch.empty_like(tree.q), cache=tree.cache, table=tree.flat)
        flat_fn = jitattn_fn(flat_data, ctx.device)
        _check_errors(case, ctx, flat_data, {"cascade": (row, fn), "two_level": (two_row, two_fn),
                                             "flat": (flat_row, flat_fn)})
        _time(ctx, [(row, fn, "timing"), (flat_row, flat_fn, "flat decode")] +
              ([(two_row, two_fn, "two-level cascade")] if two_fn else []))
        flat_row["sdpa_na"] = "see the cascade row"
        row["baseline"] = {"name": flat_row["name"], "time_us": flat_row["time_us"], "than": "flat decode",
                           "speedup": flat_row["time_us"] / row["time_us"], "what": "flat decode time / cascade time"}
        if two_row is not None:
            two_row["sdpa_na"] = "see the cascade row"
            two_row["baseline"] = {"name": row["name"], "time_us": row["time_us"], "than": "the tree cascade",
                                   "speedup": row["time_us"] / two_row["time_us"],
                                   "what": "tree cascade time / two-level time (> 1: the two-level cut is faster)"}
        if not ctx.sdpa:
            row["sdpa_na"] = "not timed (--no-sdpa)"
        else:
            ctx.check_budget("SDPA")
            groups = sdpa_groups(flat_data)
            row["sdpa"] = run_sdpa(flat_case, groups, ctx, row["time_us"], nbytes=case.bytes, flops=case.flops)
            row["note"] = join_notes(row["note"], "SDPA on contiguous KV per request (prefix copied into each)")
            del groups
    except BudgetExceeded as exc:
        row["note"] = join_notes(row["note"], str(exc))
    return [row, flat_row] + ([two_row] if two_row is not None else [])


def _tree(case: Cascade, ctx: Context) -> _Tree:
    """Pages handed out in random order: the root's, each branch's, each request's own; the levels over them."""
    b, page, nb = case.batch, case.page_size, case.branches
    if case.shared_len % page or (nb and (case.branch_len % page or b % nb)):
        raise ValueError("the shared prefix and the branches must fill whole pages, and the batch split evenly over "
                         "the branches")
    dt = TORCH_DTYPES[case.dtype]
    gen_host = torch.Generator().manual_seed(seed_of(case.name))
    gen = torch.Generator(device=ctx.device).manual_seed(seed_of(case.name))
    p_shared, p_branch = case.shared_len // page, (case.branch_len // page if nb else 0)
    p_unique = (case.unique_len + page - 1) // page
    needed = p_shared + nb * p_branch + b * p_unique
    pool = pool_pages(needed)
    order = torch.randperm(pool, generator=gen_host)[:needed].to(torch.int32)
    shared = order[:p_shared]
    branch = order[p_shared:p_shared + nb * p_branch].view(nb, p_branch)
    unique = order[p_shared + nb * p_branch:].view(b, p_unique)
    cache = random_tensor((pool, 2, page, case.num_kv_heads, case.head_dim), dt, ctx.device, gen)
    q = random_tensor((b, case.num_qo_heads, case.head_dim), dt, ctx.device, gen)
    i32 = dict(dtype=torch.int32)
    last_u = (case.unique_len - 1) % page + 1
    tails = (torch.arange(b + 1, **i32), torch.arange(0, b * p_unique + 1, p_unique, **i32),
             unique.reshape(-1).clone(), torch.full((b,), last_u, **i32))
    root = (torch.tensor([0, b], **i32), torch.tensor([0, p_shared], **i32), shared.clone(), torch.tensor([page], **i32))
    per_branch = b // nb if nb else b
    levels, two_levels = [root, tails], None
    if nb:
        branch_qo = torch.arange(0, b + 1, per_branch, **i32)
        levels.insert(1, (branch_qo, torch.arange(0, nb * p_branch + 1, p_branch, **i32), branch.reshape(-1).clone(),
                          torch.full((nb,), page, **i32)))
        per_node = p_shared + p_branch
        two_indices = torch.cat([shared.unsqueeze(0).expand(nb, -1), branch], dim=1).reshape(-1).contiguous()
        two_levels = [(branch_qo, torch.arange(0, nb * per_node + 1, per_node, **i32), two_indices,
                       torch.full((nb,), page, **i32)), tails]
    # Flat decode over the same pages: each request lists its prefix pages (root, its branch), then its own.
    prefixes = torch.cat([shared.unsqueeze(0).expand(b, -1),
                          branch.repeat_interleave(per_branch, dim=0) if nb else branch.new_empty(b, 0)], dim=1)
    per = prefixes.shape[1] + p_unique
    flat = PageTable(torch.arange(0, b * per + 1, per, **i32), torch.cat([prefixes, unique], dim=1).reshape(-1).contiguous(),
                     torch.full((b,), last_u, **i32), page)
    return _Tree(cache, q, levels, two_levels, flat)


def _check_errors(case: Cascade, ctx: Context, flat_data: AttnData, runs: dict) -> None:
    """Each row's max relative error on the first requests and the last (``runs``: name -> (row, fn))."""
    from jitattn import reference

    outs = {name: fn() for name, (row, fn) in runs.items() if fn is not None and name != "flat"}
    ctx.sync()
    checked = sorted({*range(min(REF_REQUESTS, case.batch)), case.batch - 1}) if case.batch else []
    refs = [reference.single_attention(flat_data.q[r:r + 1], *flat_data.request_kv(r))[0] for r in checked]
    for name, out in outs.items():
        runs[name][0]["max_rel_err"] = rel_err([out[r:r + 1] for r in checked], refs)
    flat_row, flat_fn = runs["flat"]
    flat_data.out.fill_(float("nan"))
    flat_fn()
    ctx.sync()
    flat_row["max_rel_err"] = rel_err([flat_data.out[r:r + 1] for r in checked], refs)


def _time(ctx: Context, runs: list[tuple]) -> None:
    """Time each (row, fn) in turn, each stage inside the case's budget."""
    for row, fn, stage in runs:
        ctx.check_budget(stage)
        set_time(row, ctx.timer.measure(fn, ctx.measure_s), ctx, fn)
