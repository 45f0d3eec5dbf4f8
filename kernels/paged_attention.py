"""Causal attention of a flattened batch over K/V read from the paged cache (torch
reference; runs on CPU and CUDA).

Sequence b owns queries [query_start[b], query_start[b+1]) which are the *last*
q_len of its seq_lens[b] tokens; every token's K/V (the new ones included) is
already in the cache. `window`: a query sees only the keys less than `window` positions
before it (Gemma's and Mistral's sliding layers); `softcap`: scores go through
softcap * tanh(s / softcap) before the softmax (Gemma 2). An FP8 cache is read as its
values times `k_scale` / `v_scale` in q's dtype (`read_kv_ref`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels.kv_store import FP8, read_kv_ref


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [num_blocks, bs, Hkv, D] -> [length, Hkv, D]
    bs = cache.shape[1]
    num = -(-length // bs)
    # index_select, not cache[ids]: ten times faster on CPU for these whole-block rows.
    return cache.index_select(0, block_table[:num]).flatten(0, 1)[:length]


def check_paged_inputs(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
) -> tuple[int, int]:
    """What the Triton attention kernels assume of their inputs; returns (block_size, Hkv)."""
    hq, dim = q.shape[1:]
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, tuple(kv_cache.shape)
    _, _, block_size, hkv, kv_dim = kv_cache.shape
    assert kv_dim == dim and dim >= 16 and dim & (dim - 1) == 0, (dim, kv_dim)
    assert hq % hkv == 0, (hq, hkv)
    assert kv_cache.dtype in (q.dtype, FP8) and q.dtype in (torch.float32, torch.bfloat16,
                                                           torch.float16), (q.dtype, kv_cache.dtype)
    assert q.stride(2) == 1 and kv_cache.stride(4) == 1, "head dims must be contiguous"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, block_tables.dtype
    assert block_tables.stride(1) == 1, block_tables.stride()
    batch = block_tables.shape[0]
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,), seq_lens.shape
    assert q.device == kv_cache.device == block_tables.device == seq_lens.device
    return block_size, hkv


# A decode row joins a group whose longest context is at most 2 x (its own + this)
# (`DecodeRows.of`), so a row's padding stays about its own size. One group for the whole
# step padded short chats beside two 1,700-token prompts to 1,700 keys each (~6x the
# bytes; SmolLM2's batched test steps on the 2-core CPU: 0.65 s each).
_PAD_TOKENS = 256


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows of similar context lengths, attended together: their K/V gathered and
    padded to the group's longest context, the rest masked."""

    queries: torch.Tensor  # [R] indices into T, in the step's order
    table: torch.Tensor  # [R, cdiv(max_len, block_size)] block ids
    max_len: int
    mask: torch.Tensor | None  # [R, 1, 1, max_len] bool; None when every row is max_len long


@dataclass(frozen=True)
class DecodeRows:
    """The rows of a step with one query each, and what attending them needs; built once
    per step, used by every layer."""

    groups: tuple[DecodeGroup, ...]

    @classmethod
    def of(
        cls,
        block_tables: torch.Tensor,
        seq_lens: list[int],
        query_start: list[int],
        block_size: int,
    ) -> DecodeRows | None:
        rows = [b for b in range(len(seq_lens)) if query_start[b + 1] - query_start[b] == 1]
        if not rows:
            return None
        groups: list[list[int]] = []  # longest first; a row joins the last one if it fits
        for b in sorted(rows, key=lambda b: -seq_lens[b]):
            if groups and seq_lens[groups[-1][0]] <= 2 * (seq_lens[b] + _PAD_TOKENS):
                groups[-1].append(b)
            else:
                groups.append([b])
        made = tuple(_group(block_tables, seq_lens, query_start, block_size, sorted(g))
                     for g in groups)
        return cls(made)


def _group(block_tables: torch.Tensor, seq_lens: list[int], query_start: list[int],
           block_size: int, rows: list[int]) -> DecodeGroup:
    dev = block_tables.device
    lens = [seq_lens[b] for b in rows]
    max_len = max(lens)
    table = block_tables[torch.tensor(rows, device=dev), : -(-max_len // block_size)]
    mask = None
    if min(lens) < max_len:
        lens_t = torch.tensor(lens, device=dev)
        mask = (torch.arange(max_len, device=dev)[None, :] < lens_t[:, None])[:, None, None, :]
    queries = torch.tensor([query_start[b] for b in rows], device=dev)
    return DecodeGroup(queries, table, max_len, mask)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: list[int],  # [B] tokens in context, the new ones included
    query_start: list[int],  # [B + 1] offsets into T
    scale: float,
    decode: DecodeRows | None = None,  # precomputed once per step; built here if None
    k: torch.Tensor | None = None,  # [T, Hkv, D]: the step's new K/V, as stored
    v: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,  # an FP8 cache's; ignored by any other
    v_scale: float = 1.0,
) -> torch.Tensor:
    """With the step's own `k` and `v`, a row whose every token is new (a whole prompt)
    attends to them where they are rather than to a copy gathered from its blocks; not
    with an FP8 cache, whose rows attend to what it holds."""
    hq, hkv = q.shape[1], kv_cache.shape[3]
    assert hq % hkv == 0, (hq, hkv)
    out = torch.empty_like(q)
    if decode is None:
        decode = DecodeRows.of(block_tables, seq_lens, query_start, kv_cache.shape[2])
    if decode is not None and window is None and softcap is None:
        _decode_batched(q, kv_cache, decode, scale, out, k_scale, v_scale)
        decoded = True
    else:
        decoded = False
    for b in range(len(seq_lens)):
        start, end, length = query_start[b], query_start[b + 1], seq_lens[b]
        if end == start or (end - start == 1 and decoded):
            continue
        if k is not None and end - start == length and kv_cache.dtype != FP8:
            kb, vb = k[start:end], v[start:end]
        else:  # [L, Hkv, D]
            kb = read_kv_ref(_gather(kv_cache[0], block_tables[b], length), k_scale, q.dtype)
            vb = read_kv_ref(_gather(kv_cache[1], block_tables[b], length), v_scale, q.dtype)
        out[start:end] = _attend(q[start:end], kb, vb, scale, window, softcap)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    # q: [Q, Hq, D], k/v: [L, Hkv, D], Q <= L; query i sits at position L - Q + i.
    n_q, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    if window is not None or softcap is not None:
        return _attend_masked(q, k, v, scale, window, softcap)
    # [1, H, L, D]: the CPU's flash kernel takes 4-D inputs only (3-D ones fall to the
    # math path, 16 of a 120-token prefill's 144 ms on SmolLM2), and no enable_gqa.
    qh = q.transpose(0, 1)[None]  # [1, Hq, Q, D]
    kh = k.transpose(0, 1).repeat_interleave(groups, 0)[None]  # [1, Hq, L, D]
    vh = v.transpose(0, 1).repeat_interleave(groups, 0)[None]
    if n_q == length:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        pos = torch.arange(length, device=q.device)
        mask = pos[None, :] <= (pos[length - n_q :, None])  # [Q, L]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def _attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   window: int | None, softcap: float | None) -> torch.Tensor:
    """`_attend` with a sliding window and soft-capped scores, spelled out as transformers'
    eager attention computes it: scores in q's dtype, softmax in fp32."""
    n_q, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)  # [Hq, Q, D]
    kh = k.transpose(0, 1).repeat_interleave(groups, 0)  # [Hq, L, D]
    vh = v.transpose(0, 1).repeat_interleave(groups, 0)
    scores = (qh @ kh.transpose(1, 2)) * scale  # [Hq, Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(length, device=q.device)
    queries = keys[length - n_q:, None]
    allowed = keys[None, :] <= queries
    if window is not None:
        allowed &= queries - keys[None, :] < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (probs @ vh).transpose(0, 1)


def _decode_batched(
    q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeRows, scale: float, out: torch.Tensor,
    k_scale: float, v_scale: float,
) -> None:
    """One query per row, a group at a time: K/V padded to the group's longest context,
    the rest masked."""
    for g in d.groups:
        o = _decode_group(q, kv_cache, g, scale, k_scale, v_scale).to(out.dtype)
        if g.queries.shape[0] == out.shape[0]:  # every query of the step, in order
            out.copy_(o)
        else:
            out[g.queries] = o


def _decode_group(
    q: torch.Tensor, kv_cache: torch.Tensor, g: DecodeGroup, scale: float,
    k_scale: float, v_scale: float,
) -> torch.Tensor:  # [R, Hq, D]
    hkv = kv_cache.shape[3]
    r = g.queries.shape[0]
    shape = (*g.table.shape, *kv_cache.shape[2:])  # [R, M, bs, Hkv, D]
    ids = g.table.flatten()
    k = kv_cache[0].index_select(0, ids).view(shape).flatten(1, 2)[:, : g.max_len]
    v = kv_cache[1].index_select(0, ids).view(shape).flatten(1, 2)[:, : g.max_len]
    k, v = read_kv_ref(k, k_scale, q.dtype), read_kv_ref(v, v_scale, q.dtype)
    qd = q[g.queries] if r != q.shape[0] else q  # [R, Hq, D]
    # A query group shares its K/V head: [R, Hkv, G, D] against [R, Hkv, L, D], no copies.
    qg = qd.view(r, hkv, q.shape[1] // hkv, -1)
    o = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask, scale=scale
    )
    return o.reshape(r, q.shape[1], -1)
