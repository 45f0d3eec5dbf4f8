"""Causal attention of a flattened batch over K/V read from the paged cache (torch
reference; runs on CPU and CUDA).

Sequence b owns queries [query_start[b], query_start[b+1]) which are the *last*
q_len of its seq_lens[b] tokens; every token's K/V (the new ones included) is
already in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [num_blocks, bs, Hkv, D] -> [length, Hkv, D]
    bs = cache.shape[1]
    num = -(-length // bs)
    return cache[block_table[:num]].flatten(0, 1)[:length]


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: list[int],  # [B] tokens in context, the new ones included
    query_start: list[int],  # [B + 1] offsets into T
    scale: float,
) -> torch.Tensor:
    hq, hkv = q.shape[1], kv_cache.shape[3]
    assert hq % hkv == 0, (hq, hkv)
    out = torch.empty_like(q)
    q_lens = [query_start[b + 1] - query_start[b] for b in range(len(seq_lens))]
    decode_rows = [b for b, n in enumerate(q_lens) if n == 1]
    if decode_rows:
        _decode_batched(q, kv_cache, block_tables, seq_lens, query_start, scale, decode_rows, out)
    for b in (b for b, n in enumerate(q_lens) if n > 1):
        start, end, length = query_start[b], query_start[b + 1], seq_lens[b]
        k = _gather(kv_cache[0], block_tables[b], length)  # [L, Hkv, D]
        v = _gather(kv_cache[1], block_tables[b], length)
        out[start:end] = _attend(q[start:end], k, v, scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [Q, Hq, D], k/v: [L, Hkv, D], Q <= L; query i sits at position L - Q + i.
    n_q, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)  # [Hq, Q, D]
    kh = k.transpose(0, 1).repeat_interleave(groups, 0)  # [Hq, L, D]
    vh = v.transpose(0, 1).repeat_interleave(groups, 0)
    if n_q == length:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        pos = torch.arange(length, device=q.device)
        mask = pos[None, :] <= (pos[length - n_q :, None])  # [Q, L]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _decode_batched(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_start: list[int],
    scale: float,
    rows: list[int],
    out: torch.Tensor,
) -> None:
    """One query per sequence: pad K/V to the longest context and mask the rest."""
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    groups = q.shape[1] // hkv
    dev = q.device
    lens = torch.tensor([seq_lens[b] for b in rows], device=dev)
    max_len = max(seq_lens[b] for b in rows)
    rows_t = torch.tensor(rows, device=dev)
    table = block_tables[rows_t, : -(-max_len // bs)]  # [R, M]
    k = kv_cache[0][table].flatten(1, 2)[:, :max_len]  # [R, L, Hkv, D]
    v = kv_cache[1][table].flatten(1, 2)[:, :max_len]
    qi = torch.tensor([query_start[b] for b in rows], device=dev)
    qd = q[qi]  # [R, Hq, D]
    # A query group shares its K/V head: [R, Hkv, G, D] against [R, Hkv, L, D], no copies.
    qg = qd.view(len(rows), hkv, groups, -1)
    kg, vg = k.transpose(1, 2), v.transpose(1, 2)
    mask = None
    if min(seq_lens[b] for b in rows) < max_len:
        mask = (torch.arange(max_len, device=dev)[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    out[qi] = o.reshape(len(rows), q.shape[1], -1).to(out.dtype)
