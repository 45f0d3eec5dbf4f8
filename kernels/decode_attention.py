"""Paged attention for decode steps: one query token per sequence against its whole
context, read from the paged KV cache (Triton), and the torch reference it is tested
against.

Layout (one layer): `kv_cache: [2, num_blocks, block_size, Hkv, D]`, K at index 0 and V
at 1. Token p of sequence b lives in block `block_tables[b, p // block_size]` at offset
`p % block_size`; only the first cdiv(seq_lens[b], block_size) entries of a row are
read. Query head h uses KV head h // G (G = Hq / Hkv), so one program takes all G query
heads of one KV head and reads that head's K/V once: q is a [G, D] tile (padded to 16
rows for tl.dot) against [BLOCK_N, D] tiles of K and V gathered a page at a time.

Split-K: the grid is (B, Hkv, num_splits). With P = cdiv(seq_len, block_size) pages and
pps = cdiv(P, num_splits), split s takes pages [s * pps, (s + 1) * pps), clipped to the
context; it is computed in the kernel from seq_lens, so the launch depends only on B,
Hkv and num_splits and can be captured in a CUDA graph. A split past the context does
no work and leaves max = -inf, sum = 0. With one split the kernel normalizes and writes
the output itself; with more, each split writes its running max m_s (log2 domain),
sum l_s and unnormalized accumulator acc_s in float32, and a second kernel merges them:

    M = max_s m_s;   out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s

`choose_num_splits` picks the split count that fills the GPU: a long context at a small
batch would otherwise run on B x Hkv SMs.

`window` > 0 (a sliding layer): the query sees only the last `window` keys, so the splits
share the pages from the one holding the first of them; `softcap` > 0: each score s
becomes softcap * tanh(s / softcap) before the softmax. Both are compile-time switches.

An FP8 cache: each K and V tile is converted to q's dtype as it is loaded (exact: every
e4m3 value is a bf16 and an fp16), k_scale joins the score scale on the host and v_scale
multiplies the accumulator once at the end; a cache in q's dtype compiles none of it.
With a bf16 q both products run in fp16 instead (`fp16_dots`): q is multiplied by the
score scale first (clamped to fp16's range: a |q| past 500,000 at head dim 128), the
tiles are widened to fp16 and the probabilities rounded to it (10 bits of mantissa
against bf16's 7). On an H100, Llama-3-8B's heads (benchmarks/decode_attention_fp8.py):
batch 128 x 576 tokens 77.8 us against 84.4 in bf16, 64 x 1,024 62.9 against 74.7,
32 x 2,048 61.8 against 76.2, 1 x 8,192 16.0 against 17.7; the same largest difference
from the reference in each. (A bf16 cache of the same shapes: 94-109 us.)
"""

from __future__ import annotations

import math

import torch

from tandem.kernels.kv_store import FP8, read_kv_ref
from tandem.kernels.paged_attention import check_paged_inputs

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: only the torch reference is usable
    triton = None

# Measured on nvidia-h200 (`python tests/test_kernel_decode_attention.py` sweeps them),
# Llama-3-8B heads, bf16: 128 context tokens per inner iteration (8 pages of 16) and three
# stages read the KV fastest of BLOCK_N 32/64/128 x 1/2/3 stages at every shape tried
# (batch 32 x 2k: 3.99 TB/s against 3.32 for 64 x 2; batch 1 x 8k, 33 splits: 2.05 against
# 1.79). fp32 tiles are twice the bytes: 64 x 2 keeps them within shared memory.
_NUM_WARPS = 4


def _tile(dtype: torch.dtype) -> tuple[int, int]:  # (BLOCK_N, stages)
    return (64, 2) if dtype == torch.float32 else (128, 3)


# tl.dot needs 16 rows; G < 16 query heads are padded with zero rows.
_MIN_GROUP_ROWS = 16
# More splits than this buy little and grow the workspaces.
_MAX_SPLITS = 64


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1, the new token included
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,  # an FP8 cache's; ignored by any other
    v_scale: float = 1.0,
    fp16_dots: bool = True,
) -> torch.Tensor:
    """Attention of each sequence's one query over its first seq_lens[b] cached tokens.
    `fp16_dots` (an FP8 cache and a bf16 q only): both products in fp16, q scaled first
    (see the module's docstring); False: in bf16.
    Nothing on the host depends on tensor values (CUDA-graph capturable); with
    num_splits > 1 it allocates float32 workspaces of B x Hq x num_splits x (D + 2)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    batch, hq, dim = q.shape
    page, hkv = check_paged_inputs(q, kv_cache, block_tables, seq_lens)
    assert block_tables.shape[0] == batch, (block_tables.shape, batch)
    assert kv_cache.stride(3) == dim and kv_cache.stride(2) == hkv * dim, "blocks contiguous"
    assert num_splits >= 1, num_splits
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if batch == 0:
        return out
    group = hq // hkv
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 applies to fp32 only
    if num_splits > 1:
        maxes = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
        accs = torch.empty(batch, hq, num_splits, dim, dtype=torch.float32, device=q.device)
    else:  # unused: the kernel writes the output
        maxes = sums = accs = out
    block_n, stages = _tile(q.dtype)
    fp8 = kv_cache.dtype == FP8
    if fp8:
        scale *= k_scale
    _decode_kernel[(batch, hkv, num_splits)](
        q, kv_cache[0], kv_cache[1], block_tables, seq_lens, out, maxes, sums, accs,
        q.stride(0), q.stride(1), kv_cache.stride(1), kv_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale if softcap else scale * math.log2(math.e), float(softcap), float(v_scale),
        WINDOW=int(window), SOFTCAP=bool(softcap), FP8=fp8,
        F16_DOTS=fp16_dots and fp8 and q.dtype == torch.bfloat16,
        GROUP=group, GROUP_ROWS=max(_MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=dim, PAGE=page, BLOCK_N=block_n, SPLIT=num_splits > 1,
        PRECISION=precision, num_warps=_NUM_WARPS, num_stages=stages,
    )
    if num_splits > 1:
        _merge_kernel[(batch, hq)](
            maxes, sums, accs, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=dim, SPLITS=triton.next_power_of_2(num_splits), num_warps=_NUM_WARPS,
        )
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Torch reference: per sequence gather its K/V, softmax in float32, return q.dtype.
    Reads seq_lens on the host."""
    page, hkv, dim = kv_cache.shape[2:]
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        pages = block_tables[b, : -(-length // page)].long()
        k = read_kv_ref(kv_cache[0, pages].flatten(0, 1)[:length], k_scale, torch.float32)
        v = read_kv_ref(kv_cache[1, pages].flatten(0, 1)[:length], v_scale, torch.float32)
        qg = q[b].float().view(hkv, -1, dim)  # [Hkv, G, D]
        scores = torch.einsum("hgd,lhd->hgl", qg, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if window:
            scores[..., : max(0, length - window)] = float("-inf")
        p = scores.softmax(-1)
        out[b] = torch.einsum("hgl,lhd->hgd", p, v).reshape(-1, dim).to(q.dtype)
    return out


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_size: int,
                      num_sms: int) -> int:
    """How many split-K partitions keep the GPU busy: enough programs (batch x kv heads x
    splits) for about two waves over num_sms, at least one page per split, at most
    _MAX_SPLITS splits; 1 when batch x kv heads already fills the GPU. Under a CUDA graph
    pass the longest context the graph may see: the split count is baked into it."""
    programs = batch * num_kv_heads
    if programs >= num_sms:
        return 1
    pages = -(-max_context // block_size)
    return max(1, min(-(-2 * num_sms // programs), pages, _MAX_SPLITS))


if triton is not None:

    @triton.jit
    def _decode_kernel(q, k_cache, v_cache, block_tables, seq_lens, out, maxes, sums, accs,
                       stride_qb, stride_qh, stride_block, stride_token, stride_table,
                       stride_ob, stride_oh, qk_scale, softcap, v_scale,
                       WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
                       F16_DOTS: tl.constexpr, GROUP: tl.constexpr,
                       GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       PRECISION: tl.constexpr):
        # program (b, h, s): split s of sequence b, query heads [h * G, (h + 1) * G).
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        seq_len = tl.load(seq_lens + b)
        lo = 0  # the first key the query sees
        if WINDOW > 0:
            lo = tl.maximum(seq_len - WINDOW, 0)
        first_page = lo // PAGE
        pages_per_split = tl.cdiv(tl.cdiv(seq_len, PAGE) - first_page, num_splits)
        start = (first_page + split * pages_per_split) * PAGE
        end = tl.minimum(start + pages_per_split * PAGE, seq_len)

        rows = tl.arange(0, GROUP_ROWS)
        heads = kv_head * GROUP + rows  # [GROUP_ROWS]; rows >= GROUP are padding
        is_head = rows < GROUP
        dims = tl.arange(0, HEAD_DIM)
        q_tile = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                         mask=is_head[:, None], other=0.0)  # [GROUP_ROWS, D]
        if F16_DOTS:  # q * scale in fp16 (clamped to its range), the scores unscaled
            q_tile = tl.clamp(q_tile.to(tl.float32) * qk_scale, -65504.0, 65504.0)
            q_tile = q_tile.to(tl.float16)
        table = block_tables + b.to(tl.int64) * stride_table
        head_offset = kv_head * HEAD_DIM  # within a token: [Hkv, D] contiguous

        m_i = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_ROWS], tl.float32)
        acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            # pos[0] is valid (with a window, lo is in the first tile, BLOCK_N >= PAGE):
            # every row's max is finite
            valid = pos < end
            if WINDOW > 0:
                valid = valid & (pos >= lo)
            block = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
            # [BLOCK_N] element offsets of each token's row for this head
            token = block * stride_block + (pos % PAGE) * stride_token + head_offset
            k = tl.load(k_cache + token[:, None] + dims[None, :], mask=valid[:, None],
                        other=0.0).to(q_tile.dtype)  # [BLOCK_N, D]; FP8: unscaled
            scores = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION)
            if not F16_DOTS:
                scores = scores * qk_scale
            if SOFTCAP:  # qk_scale is the plain scale: cap, then into the log2 domain
                scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
                scores = scores * 1.4426950408889634
            scores = tl.where(valid[None, :], scores, float("-inf"))  # [GROUP_ROWS, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache + token[:, None] + dims[None, :], mask=valid[:, None],
                        other=0.0).to(q_tile.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        if FP8:  # the values' scale, on the sum of them
            acc = acc * v_scale
        if SPLIT:  # workspaces [B, Hq, S] and [B, Hq, S, D]
            slot = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
            tl.store(maxes + slot, m_i, mask=is_head)
            tl.store(sums + slot, l_i, mask=is_head)
            tl.store(accs + slot[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=is_head[:, None])
        else:  # split 0 holds the whole context, which is never empty: l_i > 0
            o = acc / l_i[:, None]
            tl.store(out + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     o.to(out.dtype.element_ty), mask=is_head[:, None])

    @triton.jit
    def _merge_kernel(maxes, sums, accs, out, stride_ob, stride_oh, num_splits,
                      HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
        # program (b, h): query head h of sequence b, its num_splits partials merged.
        b = tl.program_id(0)
        h = tl.program_id(1)
        splits = tl.arange(0, SPLITS)
        in_range = splits < num_splits
        slot = (b * tl.num_programs(1) + h) * num_splits + splits
        m = tl.load(maxes + slot, mask=in_range, other=float("-inf"))
        weight = tl.exp2(m - tl.max(m, 0))  # empty splits (m = -inf) weigh 0
        total = tl.sum(tl.load(sums + slot, mask=in_range, other=0.0) * weight, 0)
        dims = tl.arange(0, HEAD_DIM)
        acc = tl.load(accs + slot[:, None] * HEAD_DIM + dims[None, :], mask=in_range[:, None],
                      other=0.0)  # [SPLITS, D]
        o = tl.sum(acc * weight[:, None], 0) / total
        tl.store(out + b * stride_ob + h * stride_oh + dims, o.to(out.dtype.element_ty))
