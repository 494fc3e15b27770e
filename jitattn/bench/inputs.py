"""Benchmark inputs: seeded random page tables and tensors per case, the jitattn call under test, its error
against ``jitattn.reference``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from .configs import MLA, Attn, Cascade, Case, Jit
from .ops_cases import BlockSparse, Fp8Prefill, Mixed, Rope
from .rows import REF_QUERIES, REF_REQUESTS, TORCH_DTYPES, rel_err


# --------------------------------------------------------------------------- #
# Attention data (decode / prefill, paged / ragged)
# --------------------------------------------------------------------------- #
def seed_of(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % (2**31)


def random_tensor(shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen) * 2).to(dtype)
    return torch.randn(shape, dtype=dtype, device=device, generator=gen)


def indptr_of(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


@dataclass
class PageTable:
    indptr: torch.Tensor  # host int32
    indices: torch.Tensor  # host int32
    last: torch.Tensor  # host int32
    page_size: int

    def pages(self, r: int) -> torch.Tensor:
        return self.indices[int(self.indptr[r]):int(self.indptr[r + 1])]


def random_page_table(kv_lens, page_size: int, pool: int, gen: torch.Generator) -> PageTable:
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    needed = sum(pages_per)
    order = torch.randperm(pool, generator=gen)[:needed].to(torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32)
    return PageTable(indptr_of(pages_per), order, last, page_size)


def pool_pages(needed: int) -> int:
    """A pool a quarter larger than the pages in use, so the pages used are scattered."""
    return needed + needed // 4 + 1


@dataclass
class AttnData:
    case: Attn
    q: torch.Tensor
    out: torch.Tensor
    cache: torch.Tensor | None = None  # paged: [pool, 2, page, H_kv, D]
    table: PageTable | None = None
    k: torch.Tensor | None = None  # ragged: [tokens, H_kv, D]
    v: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None  # flat bool (host)
    sinks: torch.Tensor | None = None  # float32 [H_qo] (case.sinks)

    @property
    def qo_offsets(self) -> list[int]:
        return indptr_of(list(self.case.queries)).tolist()

    @property
    def kv_offsets(self) -> list[int]:
        return indptr_of(list(self.case.kv_lens)).tolist()

    def request_kv(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's keys and values, contiguous ``[kv_len, H_kv, D]``."""
        n = self.case.kv_lens[r]
        if self.cache is None:
            s = self.kv_offsets[r]
            return self.k[s:s + n], self.v[s:s + n]
        pages = self.table.pages(r).to(self.cache.device).long()
        kv = self.cache[pages]  # [P, 2, page, H, D]
        return (kv[:, 0].reshape(-1, *kv.shape[3:])[:n], kv[:, 1].reshape(-1, *kv.shape[3:])[:n])


def causal_mask_rows(qo_len: int, kv_len: int, first_row: int = 0) -> torch.Tensor:
    """Bool [qo_len - first_row, kv_len]: rows ``first_row..`` of the bottom-right causal pattern."""
    i = torch.arange(first_row, qo_len).unsqueeze(1)
    j = torch.arange(kv_len).unsqueeze(0)
    return j <= (kv_len - qo_len) + i


def tree_mask_rows(qo_len: int, kv_len: int, seed: int, first_row: int = 0) -> torch.Tensor:
    """Bool [qo_len - first_row, kv_len]: rows ``first_row..`` of a draft tree's verification mask. The queries are
    the last ``qo_len`` keys; query i sees every key before them, its ancestors in the tree and itself (the parent
    of query i > 0 is a query before it, drawn with ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, qo_len)]
    prefix = kv_len - qo_len
    mask = torch.zeros(qo_len, kv_len, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(qo_len):
        node = i
        while node >= 0:
            mask[i, prefix + node] = True
            node = parents[node]
    return mask[first_row:]


def custom_mask_rows(case: Attn, r: int, first_row: int = 0) -> torch.Tensor:
    """Request r's rows ``first_row..`` of the case's custom mask (``case.custom_mask_kind``)."""
    qo_len, kv_len = case.queries[r], case.kv_lens[r]
    if case.custom_mask_kind == "tree":
        return tree_mask_rows(qo_len, kv_len, seed_of(case.name) + r, first_row)
    return causal_mask_rows(qo_len, kv_len, first_row)


def make_attn_data(case: Attn, device: torch.device) -> AttnData:
    gen_host = torch.Generator().manual_seed(seed_of(case.name))
    gen = torch.Generator(device=device).manual_seed(seed_of(case.name))
    dt, kvdt = TORCH_DTYPES[case.dtype], TORCH_DTYPES[case.kv_dtype]
    total_q = sum(case.queries)
    q = random_tensor((total_q, case.num_qo_heads, case.head_dim), dt, device, gen)
    out = torch.empty((total_q, case.num_qo_heads, case.dim_vo), dtype=dt, device=device)
    data = AttnData(case, q, out)
    if case.storage == "paged":
        if case.dim_vo != case.head_dim:
            raise ValueError(f"{case.name}: head_dim_vo {case.dim_vo} != head_dim {case.head_dim} takes ragged KV")
        needed = sum((n + case.page_size - 1) // case.page_size for n in case.kv_lens)
        pool = pool_pages(needed)
        data.table = random_page_table(case.kv_lens, case.page_size, pool, gen_host)
        data.cache = random_tensor((pool, 2, case.page_size, case.num_kv_heads, case.head_dim), kvdt, device, gen)
    else:
        total_kv = sum(case.kv_lens)
        data.k = random_tensor((total_kv, case.num_kv_heads, case.head_dim), kvdt, device, gen)
        data.v = random_tensor((total_kv, case.num_kv_heads, case.dim_vo), kvdt, device, gen)
    if case.custom_mask:
        data.custom_mask = torch.cat([custom_mask_rows(case, r).reshape(-1) for r in range(case.batch)])
    if case.sinks:  # around the logits' scale, so the sink matters (~log of the keys' mass)
        data.sinks = (torch.randn(case.num_qo_heads, generator=gen_host) + 4.0).to(device)
    return data


def plan_kwargs(case: Attn) -> dict:
    return dict(pos_encoding_mode=case.pos_encoding, window_left=case.window_left,
                logits_soft_cap=case.logits_soft_cap or None, q_data_type=TORCH_DTYPES[case.dtype],
                kv_data_type=TORCH_DTYPES[case.kv_dtype], batch_invariant=case.batch_invariant)


def jitattn_fn(data: AttnData, device: torch.device) -> Callable[[], object]:
    """Plan once through the public wrapper; the returned callable runs one step into ``data.out``."""
    import jitattn

    case = data.case
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    if case.op == "decode":
        wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        need = wrapper.workspace_size(case.batch, sum(case.kv_lens), case.num_qo_heads, case.num_kv_heads,
                                      case.head_dim, case.page_size, batch_invariant=case.batch_invariant)[0]
        if need > workspace.numel():
            workspace = torch.empty(need, dtype=torch.uint8, device=device)
            wrapper.reset_workspace_buffer(workspace)
        t = data.table
        wrapper.plan(t.indptr, t.indices, t.last, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                     case.page_size, **plan_kwargs(case))
        return lambda: wrapper.run(data.q, data.cache, out=data.out, sinks=data.sinks)
    qo_indptr = indptr_of(list(case.queries))
    mask = dict(custom_mask=data.custom_mask) if data.custom_mask is not None else {}
    if case.storage == "paged":
        wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        t = data.table
        wrapper.plan(qo_indptr, t.indptr, t.indices, t.last, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                     case.page_size, causal=case.causal, **mask, **plan_kwargs(case))
        return lambda: wrapper.run(data.q, data.cache, out=data.out, sinks=data.sinks)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD")
    wrapper.plan(qo_indptr, indptr_of(list(case.kv_lens)), case.num_qo_heads, case.num_kv_heads, case.head_dim,
                 head_dim_vo=case.dim_vo, causal=case.causal, **mask, **plan_kwargs(case))
    return lambda: wrapper.run(data.q, data.k, data.v, out=data.out, sinks=data.sinks)


def reference_error(data: AttnData) -> float:
    """Max relative error of ``data.out`` on the first requests (prefill: their last queries)."""
    from jitattn import reference

    case = data.case
    got, ref = [], []
    qo_off = data.qo_offsets
    for r in range(min(REF_REQUESTS, case.batch)):
        k, v = data.request_kv(r)
        qo_len = case.queries[r]
        m = min(REF_QUERIES, qo_len)
        first = qo_off[r + 1] - m
        mask = custom_mask_rows(case, r, qo_len - m).to(data.q.device) if case.custom_mask else None
        o, lse = reference.single_attention(
            data.q[first:qo_off[r + 1]], k, v, causal=case.causal, window_left=case.window_left,
            logits_soft_cap=case.logits_soft_cap or None, pos_encoding_mode=case.pos_encoding, custom_mask=mask)
        if data.sinks is not None:
            o = reference.apply_sinks(o, lse, data.sinks)
        got.append(data.out[first:qo_off[r + 1]])
        ref.append(o)
    return rel_err(got, ref)


def check_prebuilt(case: Case, target, failed_specs: dict) -> None:
    """Refuse a case one of whose kernels failed to build in the run's pre-build (``failed_specs``: spec -> why)."""
    for spec in specs_of(case, target):
        if spec in failed_specs:
            raise RuntimeError(f"build of {spec.uri} failed in the pre-build: {failed_specs[spec]}")


def specs_of(case: Case, target: str) -> list:
    """The kernel specs a case loads (the wrappers' own spec function), for the pre-build."""
    from jitattn.runtime.specs import attention_spec, merge_spec
    from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

    tgt = Target.parse(target, "target")

    def attn(c: Attn):
        mask = MaskMode.CUSTOM if c.custom_mask else (MaskMode.CAUSAL if c.causal else MaskMode.NONE)
        return attention_spec(
            Op.DECODE if c.op == "decode" else Op.PREFILL, tgt, q_dtype=TORCH_DTYPES[c.dtype],
            kv_dtype=TORCH_DTYPES[c.kv_dtype], o_dtype=TORCH_DTYPES[c.dtype], head_dim_qk=c.head_dim,
            head_dim_vo=c.dim_vo, num_qo_heads=c.num_qo_heads, num_kv_heads=c.num_kv_heads,
            pos_encoding=PosEncoding.parse(c.pos_encoding, "pos_encoding"), use_sliding_window=c.window_left >= 0,
            use_logits_soft_cap=c.logits_soft_cap > 0, mask_mode=mask if c.op == "prefill" else MaskMode.NONE,
            kv_layout=KVLayout.NHD, kv_storage=KVStorage.PAGED if c.storage == "paged" else KVStorage.RAGGED,
        ).replace(use_sinks=c.sinks)

    if isinstance(case, Attn):
        return [attn(case)]
    if isinstance(case, Cascade):
        level = Attn(case.name, "prefill", (case.shared_len,), qo_lens=(case.batch,), num_qo_heads=case.num_qo_heads,
                     num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, page_size=case.page_size,
                     dtype=case.dtype, kv_dtype=case.dtype)
        return [attn(level), attn(case.flat()), merge_spec(tgt, TORCH_DTYPES[case.dtype])]
    if isinstance(case, Jit) and case.what in ("run_overhead", "plan"):
        return [attn(jit_decode_case(case))]
    if isinstance(case, Rope):
        from jitattn.runtime.specs import rope_spec

        return [rope_spec(tgt, TORCH_DTYPES[case.dtype])]
    if isinstance(case, BlockSparse):  # planned as a paged prefill (a block row per request, a block per page)
        return [attn(Attn(case.name, "prefill", (case.seq,), qo_lens=(case.seq,), num_qo_heads=case.num_qo_heads,
                          num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, page_size=case.block,
                          dtype=case.dtype, kv_dtype=case.dtype))]
    if isinstance(case, Fp8Prefill):  # the sm90 fp8 kernel (ragged), else the single request's 16-bit paged plan
        from jitattn import hardware

        if tgt is Target.CUDA and hardware.hopper_only(hardware.known_arch_list()):
            fp8 = TORCH_DTYPES[case.dtype]
            return [attention_spec(
                Op.PREFILL, tgt, q_dtype=fp8, kv_dtype=fp8, o_dtype=TORCH_DTYPES[case.o_dtype],
                head_dim_qk=case.head_dim, head_dim_vo=case.head_dim, num_qo_heads=case.num_qo_heads,
                num_kv_heads=case.num_kv_heads, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
                use_logits_soft_cap=False, mask_mode=MaskMode.CAUSAL if case.causal else MaskMode.NONE,
                kv_layout=KVLayout.NHD, kv_storage=KVStorage.RAGGED)]
        return [attn(Attn(case.name, "prefill", (case.seq,), qo_lens=(case.seq,), page_size=case.seq,
                          num_qo_heads=case.num_qo_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                          causal=case.causal))]
    if isinstance(case, Mixed):  # the chunk and BatchAttention on the paged prefill kernel, the decodes on decode's
        chunk, decodes = case.parts()
        return [attn(replace(chunk, storage="paged")), attn(decodes)]
    if isinstance(case, MLA):  # the MLA wrapper's decode: the sm90 MLA kernel on an H100/H200, else the paged prefill
        from jitattn import hardware
        from jitattn.runtime.specs import mla_kernel_spec

        sm90 = ([mla_kernel_spec(TORCH_DTYPES[case.dtype], TORCH_DTYPES[case.cache_dtype])]
                if tgt is Target.CUDA and hardware.hopper_only(hardware.known_arch_list()) else [])
        return sm90 + [attention_spec(
            Op.PREFILL, tgt, q_dtype=TORCH_DTYPES[case.dtype], kv_dtype=TORCH_DTYPES[case.cache_dtype],
            o_dtype=TORCH_DTYPES[case.dtype], head_dim_qk=case.ckv_dim + case.kpe_dim, head_dim_vo=case.ckv_dim,
            num_qo_heads=case.num_heads, num_kv_heads=1, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
            use_logits_soft_cap=False, mask_mode=MaskMode.NONE, kv_layout=KVLayout.NHD, kv_storage=KVStorage.PAGED)]
    return []


def jit_decode_case(case: Jit) -> Attn:
    return Attn(case.name, "decode", (case.kv_len,) * case.batch)
