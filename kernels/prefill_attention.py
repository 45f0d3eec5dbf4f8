"""Causal flash attention of a packed batch of new tokens over the paged KV cache
(Triton): a fresh prompt, a chunk after a cached prefix or a chunked prefill, and decode
rows mixed in; with the torch reference it is tested against.

Layout (one layer): `kv_cache: [2, num_blocks, block_size, Hkv, D]`, K at index 0 and V
at 1. Token p of sequence b lives in block `block_tables[b, p // block_size]` at offset
`p % block_size`; only the first cdiv(seq_lens[b], block_size) entries of a row are
read, and no slot at or past seq_lens[b]. Every token's K/V, the new ones included, is
in the cache before the kernel runs.

Semantics: sequence b owns queries q[query_start[b]:query_start[b+1]], its q_len
*last* tokens of L = seq_lens[b]; query j sits at position L - q_len + j and attends
keys 0..L - q_len + j. Query head h uses KV head h // G (G = Hq / Hkv). A sequence with
q_len 0 writes nothing.

Tiles: one program takes BLOCK_Q consecutive queries of one sequence and all G query
heads of one KV head, a [BLOCK_M = BLOCK_Q x G, D] tile of q (row m: query m // G, head
m % G; for G = 3 the last BLOCK_M % G rows are padding), so each K/V tile it gathers
serves G heads, and a decode row fills G rows of the tile rather than 1. Keys run in
tiles of BLOCK_N: those before the tile's first query are read unmasked; the diagonal
tiles up to its last query mask causally (and mask every load at or past that query,
the slots and block-table entries past the context included); later tiles are never
read. Online softmax in float32 in the log2 domain, the fp32 accumulator divided once
at the end. The grid is (Hkv, B, cdiv(max_query_len, BLOCK_Q)) with the query tiles
taken last first: the longest programs (the last queries of a prompt) start first,
the short ones fill the tail. It depends only on host ints, so nothing waits on the GPU.

`window` > 0: a query sees only the keys less than `window` positions before it (a
sliding layer): the program starts at the tile holding its first query's first key, and
every tile is masked. `softcap` > 0: each score s becomes softcap * tanh(s / softcap)
before the softmax (Gemma 2). Both are compile-time switches: without them the kernel
is the one above. An FP8 cache: K and V tiles are converted to q's dtype as they are
loaded (exact), k_scale joins the score scale on the host and v_scale multiplies the
output once; a cache in q's dtype compiles none of it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from tandem.kernels.kv_store import FP8, read_kv_ref
from tandem.kernels.paged_attention import check_paged_inputs

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: only the torch reference is usable
    triton = None

_LOG2E = 1.4426950408889634


class _Tiles(NamedTuple):
    block_m: int  # query rows per program: BLOCK_Q queries x G heads, padded
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


@functools.cache
def _tiles(dtype: torch.dtype, device: torch.device) -> _Tiles:
    """bf16/fp16: the FlashAttention-2 tile, [128, D] of q against [64, D] of K and V
    on 8 warps; three stages on Hopper (96 KiB of shared memory at D 128, 176
    registers, no spills: compiled for sm_90 with Triton 3.9), two before it, where a
    third buys nothing and spills on sm_80. fp32, the exact path (no TF32), runs
    tl.dot on FMAs, whose operands take a thread's registers per row: 32 x 16 tiles
    are the largest that don't spill at D 128. Under Triton's interpreter (CPU
    tensors) small tiles keep the test shapes multi-tile."""
    if device.type != "cuda":
        return _Tiles(16, 16, 1, 1)
    if dtype == torch.float32:
        return _Tiles(32, 16, 8, 2)
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    return _Tiles(128, 64, 8, 3 if hopper else 2)


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, the new tokens included
    query_start: torch.Tensor,  # [B + 1] int32 offsets into T
    max_query_len: int,  # >= every q_len
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,  # an FP8 cache's; ignored by any other
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its first seq_lens[b] cached
    tokens; writes `out` (allocated if None) and returns it. Launch size depends only on
    B, Hkv and max_query_len: no host sync."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    tokens, hq, dim = q.shape
    page, hkv = check_paged_inputs(q, kv_cache, block_tables, seq_lens)
    batch = block_tables.shape[0]
    assert query_start.dtype == torch.int32 and query_start.shape == (batch + 1,)
    assert query_start.device == q.device
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    assert out.device == q.device
    if tokens == 0 or batch == 0 or max_query_len <= 0:
        return out
    groups = hq // hkv
    tiles = _tiles(q.dtype, q.device)
    block_m = max(tiles.block_m, triton.next_power_of_2(groups))
    block_q = block_m // groups
    grid = (hkv, batch, triton.cdiv(max_query_len, block_q))
    assert grid[1] < 1 << 16 and grid[2] < 1 << 16, grid  # CUDA's limit on grid y and z
    fp8 = kv_cache.dtype == FP8
    if fp8:
        scale *= k_scale
    _prefill_attention_kernel[grid](
        q, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start, out,
        scale if softcap else scale * _LOG2E, float(softcap), float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUPS=groups, HEAD_DIM=dim, PAGE=page, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=tiles.block_n, IEEE=q.dtype == torch.float32,
        WINDOW=int(window), SOFTCAP=bool(softcap), FP8=fp8,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W]
    seq_lens: torch.Tensor,  # [B]
    query_start: torch.Tensor,  # [B + 1]
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Torch reference: per sequence, gather its K/V, causal softmax in float32; returns
    q.dtype. Rows of q that no sequence owns are zero."""
    page, hkv = kv_cache.shape[2], kv_cache.shape[3]
    groups = q.shape[1] // hkv
    out = torch.zeros_like(q)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for b, length in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        pages = block_tables[b, : -(-length // page)].long()
        k, v = (read_kv_ref(kv_cache[i][pages].flatten(0, 1)[:length], s, torch.float32)
                for i, s in ((0, k_scale), (1, v_scale)))
        k = k.repeat_interleave(groups, 1).transpose(0, 1)  # [Hq, L, D]
        v = v.repeat_interleave(groups, 1).transpose(0, 1)
        qh = q[start:end].float().transpose(0, 1)  # [Hq, Q, D]
        scores = qh @ k.transpose(1, 2) * scale  # [Hq, Q, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(length, device=q.device)
        allowed = pos[None, :] <= pos[length - (end - start):, None]  # [Q, L]
        if window:
            allowed &= pos[length - (end - start):, None] - pos[None, :] < window
        probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
        out[start:end] = (probs @ v).transpose(0, 1).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _attend_keys(
        q_tile, k_cache, v_cache, table, kv_base, kv_block, kv_slot, qk_scale, softcap,
        n0, key_end, pos, m_i, l_i, acc,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """One online-softmax step over keys [n0, n0 + BLOCK_N) gathered through the
        block table; MASKED: keys at or past key_end are not loaded, and a row sees a
        key only at or before its position."""
        keys = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        if MASKED:
            key_ok = keys < key_end
            pages = tl.load(table + keys // PAGE, mask=key_ok, other=0)
        else:
            pages = tl.load(table + keys // PAGE)
        slots = kv_base + pages.to(tl.int64) * kv_block + (keys % PAGE) * kv_slot
        kv_offs = slots[:, None] + offs_d[None, :]
        if MASKED:
            k = tl.load(k_cache + kv_offs, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_cache + kv_offs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_cache + kv_offs)
            v = tl.load(v_cache + kv_offs)
        k = k.to(q_tile.dtype)  # an FP8 cache's values, unscaled; else a no-op
        v = v.to(q_tile.dtype)
        if IEEE:
            qk = tl.dot(q_tile, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            qk = tl.dot(q_tile, tl.trans(k)) * qk_scale
        if SOFTCAP:  # qk_scale is the plain scale: cap, then into the log2 domain
            qk = softcap * _tanh(qk / softcap) * 1.4426950408889634
        if MASKED:
            seen = keys[None, :] <= pos[:, None]
            if WINDOW > 0:
                seen = seen & (pos[:, None] - keys[None, :] < WINDOW)
            # Without a window every row keeps key 0, so the first tile already makes
            # m_new finite; with one, a row may see none of a tile: see m_ref.
            qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
        if WINDOW > 0:  # a row that has seen no key yet: exp2(-inf - -inf) must be 0
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _tanh(x):
        return 1.0 - 2.0 / (tl.math.exp(2.0 * x) + 1.0)  # +-1 at the ends, no overflow

    @triton.jit
    def _prefill_attention_kernel(
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out,
        qk_scale,  # scale x log2(e): softmax in powers of 2 (SOFTCAP: the plain scale)
        softcap, v_scale,
        q_token, q_head, out_token, out_head,
        kv_block, kv_slot, kv_head,
        table_row,
        GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
    ):
        # program (h, b, t): KV head h, sequence b, query tile t counted from the end.
        kv_h = tl.program_id(0)
        b = tl.program_id(1)
        q_start = tl.load(query_start + b)
        q_len = tl.load(query_start + b + 1) - q_start
        q0 = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_Q
        if q0 >= q_len:
            return
        past = tl.load(seq_lens + b) - q_len  # cached tokens before the first query

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        query = q0 + offs_m // GROUPS
        row_ok = (offs_m < BLOCK_Q * GROUPS) & (query < q_len)
        head = kv_h * GROUPS + offs_m % GROUPS
        token = (q_start + query).to(tl.int64)
        q_tile = tl.load(q + (token * q_token + head * q_head)[:, None] + offs_d[None, :],
                         mask=row_ok[:, None], other=0.0)
        pos = past + query  # [BLOCK_M] the query's position in its sequence

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        table = block_tables + b.to(tl.int64) * table_row
        kv_base = kv_h.to(tl.int64) * kv_head

        # Keys before the tile's first query: every row sees them, all are in the context
        # (with a window: from the tile of the first query's first key, all masked).
        key_end = past + tl.minimum(q0 + BLOCK_Q, q_len)
        if WINDOW > 0:
            unmasked_end = tl.maximum(past + q0 + 1 - WINDOW, 0) // BLOCK_N * BLOCK_N
        else:
            unmasked_end = (past + q0 + 1) // BLOCK_N * BLOCK_N
            for n0 in range(0, unmasked_end, BLOCK_N):
                m_i, l_i, acc = _attend_keys(
                    q_tile, k_cache, v_cache, table, kv_base, kv_block, kv_slot, qk_scale,
                    softcap, n0, unmasked_end, pos, m_i, l_i, acc,
                    HEAD_DIM, PAGE, BLOCK_N, False, IEEE, WINDOW, SOFTCAP)
        # The diagonal, up to the tile's last query, masked causally. Keys at or past
        # key_end are never loaded: their pages may be garbage, their slots unwritten.
        for n0 in range(unmasked_end, key_end, BLOCK_N):
            m_i, l_i, acc = _attend_keys(
                q_tile, k_cache, v_cache, table, kv_base, kv_block, kv_slot, qk_scale,
                softcap, n0, key_end, pos, m_i, l_i, acc,
                HEAD_DIM, PAGE, BLOCK_N, True, IEEE, WINDOW, SOFTCAP)

        acc = acc / l_i[:, None]
        if FP8:  # the values' scale, on their weighted mean
            acc = acc * v_scale
        o_offs = (token * out_token + head * out_head)[:, None] + offs_d[None, :]
        tl.store(out + o_offs, acc.to(out.dtype.element_ty), mask=row_ok[:, None])
