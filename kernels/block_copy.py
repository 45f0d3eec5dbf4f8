"""Copy whole KV blocks between a paged cache and a contiguous staging buffer: the gather
before a KV transfer and the scatter after it, any number of layers in one launch.

Both sides are seen as rows of blocks, `[R, num_blocks, E]`: R = 2 x layers (K and V of
each layer), E = block_size x kv_heads x head_dim elements per block, contiguous. Row r
of `src` goes to row r of `dst`:

    dst[r, dst_ids[i]] = src[r, src_ids[i]]        for every r and i (ids None: i itself)

With a `guard` (tags, ticket), block i is written only if tags[dst_ids[i]] == ticket when
it is copied: the check a process makes before writing into another process's cache,
whose owner clears a block's tag before it reuses the block (`kvtransfer/ipc.py`). The
ticket may be a tensor, ticket[i] for block i: the blocks of several sinks, each with its
own ticket, in one copy.

A block is E contiguous elements, so on CUDA this is a plain vectorized copy (Triton);
torch's index_select/index_copy_ reach a fraction of the memory bandwidth on these
shapes and keep every SM busy while the NCCL kernels wait for one. The torch reference
runs everywhere else and is what the Triton kernel is tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

# Bytes per program: 32 KiB, 16-byte vectors across 4 warps (a Llama-3-8B bf16 block is one
# tile; measured on nvidia-h200-x2, GPU to GPU, 2% faster than 8 KiB tiles).
_TILE_BYTES = 32 << 10


def _check(src: torch.Tensor, src_ids: torch.Tensor | None,
           dst: torch.Tensor, dst_ids: torch.Tensor | None) -> int:
    """The number of blocks copied; raises ValueError on views this copy can't take."""
    if src.dim() != 3 or dst.dim() != 3:
        raise ValueError(
            f"want [R, blocks, E] views, got {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2] or src.dtype != dst.dtype:
        raise ValueError(f"{tuple(src.shape)} {src.dtype} does not copy into "
                         f"{tuple(dst.shape)} {dst.dtype}")
    if src.stride(2) != 1 or dst.stride(2) != 1:
        raise ValueError("each block must be contiguous (stride 1 along E)")
    counts = {ids.numel() for ids in (src_ids, dst_ids) if ids is not None}
    counts |= {side.shape[1] for side, ids in ((src, src_ids), (dst, dst_ids)) if ids is None}
    if len(counts) != 1:
        raise ValueError(f"block counts disagree: {sorted(counts)}")
    return counts.pop()


# (int32 tags per destination block, the ticket: one, or a tensor of one per block copied)
Guard = tuple[torch.Tensor, int | torch.Tensor]


def copy_blocks_reference(src: torch.Tensor, src_ids: torch.Tensor | None,
                          dst: torch.Tensor, dst_ids: torch.Tensor | None,
                          guard: Guard | None = None) -> None:
    """torch ops, with no temporary where it can be helped: on CPU a fresh temporary of
    a request's blocks costs its page faults, several times the copy itself. A guard is
    checked block by block, just before each block is written."""
    if guard is not None:
        tags, ticket = guard
        n = dst.shape[1] if dst_ids is None else dst_ids.numel()
        s_ids = range(n) if src_ids is None else src_ids.tolist()
        d_ids = range(n) if dst_ids is None else dst_ids.tolist()
        tickets = ticket.tolist() if isinstance(ticket, torch.Tensor) else [ticket] * n
        for s, d, t in zip(s_ids, d_ids, tickets, strict=True):
            if int(tags[d]) == t:
                dst[:, d].copy_(src[:, s])
        return
    if src_ids is None:
        if dst_ids is None:
            dst.copy_(src)
        else:
            dst.index_copy_(1, dst_ids, src)
    elif dst_ids is None:
        if dst.is_contiguous():
            torch.index_select(src, 1, src_ids, out=dst)
        else:
            dst.copy_(src.index_select(1, src_ids))
    elif src.is_cuda:
        dst.index_copy_(1, dst_ids, src.index_select(1, src_ids))  # the allocator reuses it
    else:
        for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
            dst[:, d].copy_(src[:, s])


def copy_blocks(src: torch.Tensor, src_ids: torch.Tensor | None,
                dst: torch.Tensor, dst_ids: torch.Tensor | None,
                guard: Guard | None = None, *, use_triton: bool | None = None) -> None:
    """`dst[:, dst_ids] = src[:, src_ids]` on `[R, blocks, E]` views (ids: int64 on the
    same device, None for 0..n-1), enqueued on the current stream; with a `guard`, only
    the blocks whose tag holds its ticket. dst_ids must be distinct. `use_triton` None:
    Triton on CUDA when it is installed."""
    plan_copy(src, src_ids, dst, dst_ids, guard, use_triton=use_triton)()


def plan_copy(src: torch.Tensor, src_ids: torch.Tensor | None,
              dst: torch.Tensor, dst_ids: torch.Tensor | None,
              guard: Guard | None = None, *, use_triton: bool | None = None
              ) -> Callable[[], None]:
    """`copy_blocks` checked and set up now; each call of the result enqueues the copy on
    the then current stream, as cheaply as a launch can be from Python: the copy a KV push
    starts with is planned before its data is due. The tensors must stay alive and in
    place (the ids' values and the tags may change)."""
    n = _check(src, src_ids, dst, dst_ids)
    if guard is not None and isinstance(guard[1], torch.Tensor) and guard[1].numel() != n:
        raise ValueError(f"{guard[1].numel()} tickets for {n} blocks")
    if src.dtype == torch.float8_e4m3fn:  # its bytes: the CPU has no index_copy_ for FP8
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    if use_triton is None:
        use_triton = triton is not None and src.is_cuda
    if not use_triton:
        return functools.partial(copy_blocks_reference, src, src_ids, dst, dst_ids, guard)
    if triton is None:
        raise RuntimeError("Triton is not installed")
    rows, _, elems = src.shape
    if n == 0 or rows == 0:
        return lambda: None
    tile = min(_TILE_BYTES // src.element_size(), triton.next_power_of_2(elems))
    tags, ticket = guard if guard is not None else (dst, 0)
    per_block = isinstance(ticket, torch.Tensor)
    return _Launch(
        (n, rows, -(-elems // tile)),
        (src, dst,
         src_ids if src_ids is not None else src, dst_ids if dst_ids is not None else dst,
         tags, ticket if per_block else tags, 0 if per_block else ticket,
         src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), elems),
        (tile, src_ids is not None, dst_ids is not None, guard is not None, per_block),
    )


# Compiled kernels by what Triton specializes them on (`_key`). Triton's own launch binds
# and specializes every argument in Python on every call, ~3x the cost of the launch
# itself; a KV push is one launch on the critical path, so a kernel seen once is
# launched directly after that.
_compiled: dict[tuple, Any] = {}
_NUM_WARPS = 4
# The current CUDA stream as Triton gets it (torch.cuda.current_stream builds an object).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                      lambda device: torch.cuda.current_stream(device).cuda_stream)


def _key(args: tuple, constexprs: tuple) -> tuple:
    """Everything Triton's compiled code depends on, and more: the pointers' element types
    and 16-byte alignment, the strides and sizes themselves (fixed for a cache), the
    ticket's width (it is not specialized on otherwise)."""
    src, _, src_ids, dst_ids, tags, tickets, ticket, *ints = args
    return (constexprs, src.dtype, src_ids.dtype, tags.dtype, tickets.dtype,
            src.data_ptr() & 15, args[1].data_ptr() & 15, src_ids.data_ptr() & 15,
            dst_ids.data_ptr() & 15, tags.data_ptr() & 15, tickets.data_ptr() & 15,
            ticket >= 2**31, *ints)


def _hooked() -> bool:
    """A profiler asked Triton to hear of every launch: launch through Triton then."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    hook = getattr(runtime, "launch_enter_hook", None)
    # Recent Triton holds an empty chain of hooks here, never None, when no one listens.
    return hook is not None and bool(getattr(hook, "calls", True))


class _Launch:
    """`_copy_blocks_kernel[grid](*args, *constexprs)`, on the current device and stream
    of each call: through Triton the first time on a device, directly after that."""

    def __init__(self, grid: tuple[int, int, int], args: tuple, constexprs: tuple) -> None:
        self.grid, self.args, self.constexprs = grid, args, constexprs
        self.key = _key(args, constexprs) if args[0].is_cuda else None
        self.kernel, self.device = None, -1

    def __call__(self) -> None:
        if self.key is None:  # Triton's interpreter, on CPU tensors
            self._through_triton()
            return
        device = torch.cuda.current_device()
        if device != self.device:
            self.kernel, self.device = _compiled.get((device, *self.key)), device
        kernel = self.kernel
        if kernel is None or _hooked():
            kernel = self._through_triton()
            if getattr(kernel, "function", None) is not None and len(_compiled) < 256:
                _compiled[(device, *self.key)] = self.kernel = kernel
            return
        kernel.run(*self.grid, _raw_stream(device), kernel.function, kernel.packed_metadata,
                   None, None, None, *self.args, *self.constexprs)

    def _through_triton(self) -> Any:
        tile, src_ids, dst_ids, guarded, tickets = self.constexprs
        return _copy_blocks_kernel[self.grid](*self.args, TILE=tile, SRC_IDS=src_ids,
                                              DST_IDS=dst_ids, GUARD=guarded,
                                              TICKETS=tickets, num_warps=_NUM_WARPS)


if triton is not None:

    @triton.jit(do_not_specialize=["ticket"])  # one compiled kernel for every ticket
    def _copy_blocks_kernel(src, dst, src_ids, dst_ids, tags, tickets, ticket,
                            src_row, src_block, dst_row, dst_block, elems,
                            TILE: tl.constexpr, SRC_IDS: tl.constexpr, DST_IDS: tl.constexpr,
                            GUARD: tl.constexpr, TICKETS: tl.constexpr):
        # program (i, r, t): tile t of block i of row r. Offsets in int64: a cache is
        # often more than 2**31 elements.
        i = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1).to(tl.int64)
        t = tl.program_id(2)
        s = tl.load(src_ids + i).to(tl.int64) if SRC_IDS else i
        d = tl.load(dst_ids + i).to(tl.int64) if DST_IDS else i
        offs = t * TILE + tl.arange(0, TILE)
        if GUARD:  # read now, not cached: the owner may have cleared it since the launch
            tag = tl.load(tags + d, volatile=True)
            want = tl.load(tickets + i) if TICKETS else ticket
            elems = tl.where(tag == want, elems, 0)
        mask = offs < elems
        x = tl.load(src + r * src_row + s * src_block + offs, mask=mask)
        tl.store(dst + r * dst_row + d * dst_block + offs, x, mask=mask)
