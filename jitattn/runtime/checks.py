"""Input checks and target/stream resolution shared by every op.

The target follows the data: tensors on a CUDA device run the ``cuda``
target on that device, tensors on the CPU the ``cpu`` target.
"""

from __future__ import annotations

import functools

from typing import Iterable

import torch

from ..page_table import to_host_int32
from ..spec import Target

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # the fp8 dtypes jitattn takes (q / kv, as FlashInfer)


def target_of(what: str, tensors: Iterable[torch.Tensor | None]) -> tuple[Target, torch.device]:
    """The (target, device) all ``tensors`` live on; a clear error if they are mixed."""
    devices = {t.device for t in tensors if t is not None}
    if not devices:
        raise ValueError(f"{what}: no tensors given")
    if len(devices) > 1:
        listed = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{what}: tensors are on different devices ({listed}); move them to one device")
    device = devices.pop()
    if device.type == "cuda":
        return Target.CUDA, device
    if device.type == "cpu":
        return Target.CPU, device
    raise ValueError(f"{what}: device {device} is not supported; use a CUDA device or the CPU")


def stream_handle(device: torch.device) -> int | None:
    """The raw stream to launch on: the current stream of ``device`` (None on the CPU)."""
    if device.type != "cuda":
        return None
    if _raw_stream is not None:  # ~0.2 us instead of ~7 us for a Stream object on a slow host
        return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


_get_device = getattr(torch._C, "_cuda_getDevice", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def current_cuda_device() -> int:
    """The current CUDA device index (the C call itself: the hot path runs only after CUDA is initialised)."""
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def stream_capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return bool(_capturing()) if _capturing is not None else torch.cuda.is_current_stream_capturing()


def raw_stream(device_index: int) -> int:
    """The current stream of CUDA device ``device_index``, as a raw handle."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def launch_on(module, entry: str, device: torch.device, **params) -> None:
    """``module.launch(entry, ...)`` on ``device``'s current stream (the cpu: no stream). The device is made
    current only when it is not already: the context switch costs more host time than the launch."""
    if device.type != "cuda":
        module.launch(entry, None, **params)
        return
    index = device.index if device.index is not None else current_cuda_device()
    if index != current_cuda_device():
        with torch.cuda.device(index):
            module.launch(entry, raw_stream(index), **params)
    else:
        module.launch(entry, raw_stream(index), **params)


def cpu_threads() -> int:
    """OpenMP threads for a cpu-target launch: follows torch.get_num_threads()."""
    return max(1, torch.get_num_threads())


def not_planned(wrapper: str, method: str = "run", first: str = "plan() once per batch") -> RuntimeError:
    """The error of a wrapper's ``method`` called without a plan: none was made yet, or the last ``plan()`` raised
    (a refused plan leaves none, so the previous batch's is never run by mistake)."""
    return RuntimeError(f"{wrapper}.{method}() called without a plan: call {first} first (a plan() that raised "
                        "leaves none; fix what it reported and call it again)")


def check_tensor(
    name: str, tensor: torch.Tensor, *, ndim: int | None = None, dtypes: tuple[torch.dtype, ...] | None = None,
    last_dim_contiguous: bool = True,
) -> None:
    """Raise a ValueError/TypeError naming ``name`` when the tensor has the wrong rank, dtype or strides."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested or tensor.layout is not torch.strided:
        kind = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
        raise TypeError(f"{name} is a {kind} tensor; the kernels take dense (strided) tensors: pass "
                        + ("one padded or concatenated tensor" if tensor.is_nested else f"{name}.to_dense()"))
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}; expected one of {allowed}")
    if last_dim_contiguous and tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {tensor.stride(-1)}); pass a "
                         "tensor whose last dimension has stride 1 (.contiguous() makes a copy: for a tensor the call "
                         "writes, allocate one with torch.empty)")


def check_planned_dtype(name: str, tensor: torch.Tensor, planned: torch.dtype, plan_arg: str) -> None:
    """``tensor``'s dtype against the one plan() was given as ``plan_arg``; the error says both ways to agree."""
    if tensor.dtype != planned:
        given, want = (str(d).removeprefix("torch.") for d in (tensor.dtype, planned))
        raise TypeError(f"{name} has dtype {given} but the plan has {plan_arg}={want}; pass {plan_arg}=torch.{given} "
                        f"to plan() (or cast {name} to {want})")


def check_no_overlap(name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor to be written whose elements share memory (a stride of 0 over a dimension longer
    than 1, as ``expand()`` makes): the writes would overwrite each other."""
    if any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape)):
        raise ValueError(
            f"{name} (shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}) has elements that share "
            "memory (as expand() makes), so the results written to it would overwrite each other; pass a tensor "
            "with storage of its own (.clone() or torch.empty)"
        )


def spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes two tensors span (from their first to their last element) overlap."""
    spans = []
    for t in (a, b):
        if t.numel() == 0:
            return False
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()))
    return spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]


def dense_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors that are each dense (contiguous) share bytes; False when either is not dense: the
    elements of two strided views of one buffer may interleave without sharing any (two states of a stacked
    layout), which this check, cheap enough for every call (~0.4 us), cannot tell apart."""
    if not (a.is_contiguous() and b.is_contiguous()):
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share an element: dense ones by their byte ranges; otherwise their spans overlap and,
    for views of one buffer with the same steps (disjoint column slices, the K and V of one cache share none),
    exactly; views this cannot tell apart count as sharing."""
    if a.is_contiguous() and b.is_contiguous():
        return dense_overlap(a, b)
    shared = shares_element(a, b)
    return spans_overlap(a, b) if shared is None else shared


def byte_extent(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (0 when empty; torch strides are never negative)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def outputs_meet_inputs(extents, pointers) -> bool:
    """Whether the byte range of out or lse (``pointers[3:]``, None: not the caller's) meets that of q, k, v or
    the other output (``extents`` / ``pointers``: q, k, v, out, lse): a meeting that ``refuse_outputs_over_inputs``
    then decides element by element. Disjoint ranges share no memory, so most calls stop at these comparisons."""
    for i in (3, 4):
        a = pointers[i]
        if a is None:
            continue
        a_end = a + extents[i]
        for j in range(5):
            b = pointers[j]
            if j != i and b is not None and a < b + extents[j] and b < a_end:
                return True
    return False


def refuse_in_workspace(wrapper: str, region: tuple[int, int], extents, pointers) -> None:
    """Refuse q, k, v, out or lse (their byte ``extents`` and ``pointers``; None: not the caller's) whose bytes meet
    ``region``, the ``[start, end)`` of the workspace a launch writes its split-KV partials into while it uses them."""
    lo, hi = region
    i = 0
    for ptr in pointers:  # (run() calls this every time: the loop kept to its comparisons)
        if ptr is not None and lo - extents[i] < ptr < hi:
            name = ("q", "k", "v", "out", "lse")[i]
            raise ValueError(f"{wrapper}.run(): {name} lies in the float workspace's first {hi - lo} bytes, where this "
                             f"plan's split-KV partials are written during the launch; keep {name} outside the "
                             "float_workspace_buffer")
        i += 1


def written_over(written: torch.Tensor, reads) -> str | None:
    """The name of the first of ``reads`` ((name, tensor or None) pairs) that shares memory with ``written``, or None.
    Cheap on the hot path: a read that starts past ``written``'s storage, or that ends (its own storage does) before
    it, is not compared (two tensors of separate allocations never are); only reads in the same memory are."""
    if written.layout is not torch.strided:
        return None  # (the callers' own checks refuse other layouts)
    storage = written.untyped_storage()
    lo = storage.data_ptr()
    hi = lo + storage.nbytes()
    for name, read in reads:
        if not isinstance(read, torch.Tensor) or read.layout is not torch.strided or read.data_ptr() >= hi:
            continue
        if read.data_ptr() < lo:  # another storage; an alias of the same memory (from_dlpack, from_numpy) may reach in
            other = read.untyped_storage()
            if other.data_ptr() + other.nbytes() <= lo:
                continue
        if shares_memory(written, read):
            return name
    return None


def refuse_written_over(where: str, outputs, reads) -> None:
    """Refuse the first of ``outputs`` ((name, tensor or None) pairs a launch writes) that shares memory with one of
    ``reads`` (``written_over``), which the launch reads while it writes it, or with another output."""
    written = [(name, t) for name, t in outputs if isinstance(t, torch.Tensor)]
    for i, (name, tensor) in enumerate(written):
        read = written_over(tensor, reads)
        if read is not None:
            raise ValueError(f"{where}: {name} shares memory with {read}, which the kernel reads while it writes "
                             f"{name}; pass a separate {name} buffer (torch.empty_like)")
        other = written_over(tensor, written[i + 1:])
        if other is not None:
            raise ValueError(f"{where}: {name} and {other} share memory, so one would overwrite the other; pass "
                             "separate buffers")


def refuse_outputs_over_inputs(where: str, q: torch.Tensor, kv, out: torch.Tensor | None,
                               lse: torch.Tensor | None, sinks: torch.Tensor | None = None) -> None:
    """A caller's ``out`` / ``lse`` against the inputs a launch reads while it writes them (``q``, ``kv``: a cache
    tensor or a (k, v) pair, and the ``sinks``) and against each other (``written_over``: strided views too, such as
    an out cut from the cache's own buffer)."""
    if isinstance(kv, torch.Tensor):
        caches = (("the kv cache", kv),)
    elif isinstance(kv, (tuple, list)) and len(kv) == 2:
        caches = (("k", kv[0]), ("v", kv[1]))
    else:
        caches = ()  # (the caller's own checks refuse it, by name)
    refuse_written_over(where, (("out", out), ("lse", lse)), (("q", q), *caches, ("sinks", sinks)))


def _reachable(offset: int, dims: list[tuple[int, int, int]]) -> bool:
    """Whether ``offset`` is ``sum(j * stride)`` with ``lo <= j <= hi`` for each (lo, hi, stride) of ``dims`` (largest
    stride first, each above the reach of the smaller ones: then only the two multiples around it can work)."""
    if not dims:
        return offset == 0
    (lo, hi, stride), rest = dims[0], dims[1:]
    reach = sum(max(-low, high) * st for low, high, st in rest)
    return any(lo <= j <= hi and abs(offset - j * stride) <= reach and _reachable(offset - j * stride, rest)
               for j in (offset // stride, offset // stride + 1))


def views_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one page shape, strides and dtype (two caches cut from one buffer) share an element:
    element i of ``b`` is at ``d`` + i's offset in ``a``, so they share one when ``d`` is the difference of two element
    offsets (page p of ``a`` against page q of ``b``: p - q from -(pages of b - 1) to pages of a - 1). The K and V
    views of one ``[pages, 2, ...]`` tensor, or two heads of one page, interleave without sharing any. Views of
    other shapes, or strides that do not nest (each dimension's above the span of the smaller ones): False."""
    return a.shape[1:] == b.shape[1:] and shares_element(a, b) is True


def shares_element(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether two views of one buffer share a byte, exactly when their dimensions step alike in bytes (the extents
    and dtypes may differ: column slices of one buffer, ``buf[..., :512]`` and ``buf[..., 512:]``, interleave without
    sharing any, also as an fp8 and a bf16 view of one byte buffer), compared dimension by dimension or, where the
    ranks or steps differ, after merging the dimensions each view walks as one (a head slice of a cache against a
    token-major view of its pages; q and out as column slices of different widths); None when this cannot tell
    (steps that still differ or do not nest). A dimension of size 1 steps nowhere: its stride is not compared."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    return _views_share(b.data_ptr() - a.data_ptr(), _byte_dims(a.shape, a.stride(), a.element_size()),
                        _byte_dims(b.shape, b.stride(), b.element_size()))


@functools.lru_cache(maxsize=256)  # a layout that keeps its buffers pays the search once
def _views_share(offset: int, dims_a: tuple[tuple[int, int], ...], dims_b: tuple[tuple[int, int], ...]) -> bool | None:
    if len(dims_a) == len(dims_b):
        dims = []
        for (na, sa), (nb, sb) in zip(dims_a, dims_b):
            if na == 1 and nb == 1:
                continue
            sa, sb = (sb, sb) if na == 1 else (sa, sa) if nb == 1 else (sa, sb)
            if sa != sb:
                break
            dims.append((na, nb, sa))
        else:
            shared = _offset_shared(offset, tuple(d[0] for d in dims), tuple(d[1] for d in dims),
                                    tuple(d[2] for d in dims))
            if shared is not None:
                return shared
    merged_a, merged_b = _merged_dims(dims_a), _merged_dims(dims_b)
    if len(merged_a) != len(merged_b) or any(sa != sb for (_, sa), (_, sb) in zip(merged_a, merged_b)):
        return None
    return _offset_shared(offset, tuple(n for n, _ in merged_a), tuple(n for n, _ in merged_b),
                          tuple(st for _, st in merged_a))


def _merged_dims(dims: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """``_byte_dims``' (extent, step) with the dimensions of one extent dropped and each dimension that steps by
    the whole of the one inside it merged into that one (a contiguous run of heads and head dims is one row)."""
    merged: list[tuple[int, int]] = []
    for n, step in reversed(dims):
        if n == 1:
            continue
        if merged and step == merged[-1][0] * merged[-1][1]:
            merged[-1] = (n * merged[-1][0], merged[-1][1])
        else:
            merged.append((n, step))
    return merged[::-1]


def _byte_dims(shape: tuple[int, ...], stride: tuple[int, ...], e: int) -> tuple[tuple[int, int], ...]:
    """(extent, step in bytes) of each dimension; a last dimension of one element steps as its bytes, else the
    bytes of an element follow as a dimension of their own."""
    dims = [(n, st * e) for n, st in zip(shape, stride)]
    if dims and stride[-1] == 1:
        dims[-1] = (shape[-1] * e, 1)
        dims.append((1, 1))  # (every view has rank + 1 entries, paired by position)
    else:
        dims.append((e, 1))
    return tuple(dims)


@functools.lru_cache(maxsize=256)  # a serving loop appends to the same few caches every step
def _offset_shared(offset: int, shape_a: tuple[int, ...], shape_b: tuple[int, ...],
                   strides: tuple[int, ...]) -> bool | None:
    bounds = [(1 - nb, na - 1) for na, nb in zip(shape_a, shape_b)]  # index of a minus index of b, per dimension
    dims = sorted(((lo, hi, st) for (lo, hi), st in zip(bounds, strides) if hi > lo), key=lambda d: -d[2])
    if any(st <= sum(max(-lo, hi) * t for lo, hi, t in dims[i + 1:]) for i, (_, _, st) in enumerate(dims)):
        return None
    return _reachable(offset, dims)


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(expected)}")


def refuse_paged_arguments(api: str, num_qo_heads) -> None:
    """A ragged wrapper's ``plan`` given a paged cache's arguments (its third is then the page indices): say so,
    not what the shifted arguments break further on."""
    if isinstance(num_qo_heads, torch.Tensor):
        raise TypeError(f"{api}.plan got a tensor as num_qo_heads: it takes (qo_indptr, kv_indptr, num_qo_heads, "
                        "num_kv_heads, head_dim_qk, ...) over contiguous k / v; a paged cache's (indptr, indices, "
                        "last_page_len) plan on the paged wrapper (BatchPrefillWithPagedKVCacheWrapper)")


def fast_page_table(
    indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, override: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``fast_decode_plan``'s page table, checked without a device sync: (indptr, indices, last_page_len as packed
    int32 (a strided view's copy: the kernel reads them packed), indptr on the host (``override``,
    ``global_override_indptr_cpu``, when given), the batch size). Dtypes, ranks and lengths only: the page indices
    are trusted (their values stay on the device)."""
    for name, array in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        check_tensor(name, array, ndim=1, dtypes=(torch.int32,), last_dim_contiguous=False)
    indptr, indices, last_page_len = indptr.contiguous(), indices.contiguous(), last_page_len.contiguous()
    source = "indptr" if override is None else "global_override_indptr_cpu"
    host = to_host_int32(source, indptr if override is None else override)  # FlashInfer copies indptr too
    if host.numel() != indptr.numel():
        raise ValueError(f"global_override_indptr_cpu has {host.numel()} entries but indptr has {indptr.numel()}; "
                         "pass the host copy of this step's indptr")
    batch = host.numel() - 1
    if batch < 0 or last_page_len.numel() != batch:
        raise ValueError(f"{source} describes {batch} requests but last_page_len has {last_page_len.numel()}")
    pages = int(host.numpy()[-1])
    if indices.numel() < pages:
        raise ValueError(f"{source}[-1] = {pages} pages but indices has {indices.numel()} entries: the last "
                         "requests' pages would be read past its end")
    return indptr, indices, last_page_len, host, batch


def named_refusals(wrapper: str, part: str, run):
    """``run()``; a ValueError / TypeError it raises is prefixed with ``wrapper``'s run and ``part`` (what the caller
    passed to it): the inner wrapper that ``run`` calls names its own arguments (q, indices), not the caller's
    (q_d, kv_indices_d)."""
    try:
        return run()
    except (ValueError, TypeError) as exc:
        message = f"{wrapper}.run(), the {part}: {exc}"
        try:  # the error's own type (WorkspaceTooSmall, which callers catch), else its base
            prefixed = type(exc)(message)
        except Exception:
            prefixed = (ValueError if isinstance(exc, ValueError) else TypeError)(message)
        raise prefixed from exc
