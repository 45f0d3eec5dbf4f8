"""Mixture of experts over stacked expert weights: `gate_up` [E, 2F, D] (each expert's
gate rows, then its up rows, as the dense MLP's fused GEMM) and `down` [E, D, F]. Each
token goes to the top-k experts of the router's softmax (renormalised over those k where
the family says so); their SwiGLU outputs, weighted, are summed.

`fused_moe_ref` is the torch reference: per expert, the tokens routed to it, in expert
order, as transformers computes it (so fp32 results match it exactly). It is
data-dependent (which experts are hit), so a CUDA graph cannot hold it (`data_dependent`
in engine/models). `fused_moe` has only fixed sizes and reads nothing back to the host, so
decode steps replay it in CUDA graphs.

`fused_moe` is the grouped GEMM (vLLM's `fused_moe` scheme): the T*k (token, slot) pairs
are sorted by expert and each expert's run padded to a multiple of BLOCK_M (`align`, torch
ops of fixed sizes), so every BLOCK_M rows of the sorted order belong to one expert; one
kernel computes x @ gate_up[e].T for those rows (each row reads its token's x), SwiGLU
follows, and the same kernel computes act @ down[e].T times the pair's routing weight,
written at the pair's row; the k rows of a token are summed last, in fp32 (`_sum_pairs`).

A decode step of a few tokens routes fewer pairs than there are experts: then sorting is
all overhead (a dozen small kernels a layer, most of a Qwen3-30B-A3B step), so each pair
is its own row instead (`pair_gemv`: program (pair, column block) reads its expert's
rows), and the routing is one kernel (`_route_kernel`: softmax, top k by repeated
argmax, renormalisation), so the experts cost five kernels a layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.silu_mul import silu_mul

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None

BLOCK_M = 16  # sorted rows per program: each expert's run is padded to a multiple of it


def tiles(pairs: int, experts: int) -> dict[str, int]:
    """The grouped GEMM's tiles: a decode step routes a few rows to each expert it hits,
    so small row blocks (little padding); a prefill routes many, so tensor-core-sized
    tiles. Measured on an H200 with Qwen3-30B-A3B's experts (`benchmarks/moe_tiles.py`,
    uniform routing): at 1 to 64 tokens every small tile is within 1% of the best; at
    2,048 tokens 128 x 256 x 64 took 0.81 ms a layer and these 0.89, but the engine run
    that had it (with the one-kernel routing) prefilled 2,048 tokens of a dummy model in
    84 ms against 65 ms before, and in fp32 it needs more shared memory than an H200 has.
    """
    if pairs <= 4 * experts:
        return {"BLOCK_M": BLOCK_M, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] in the logits' dtype, expert ids [T, k]): the
    softmax in fp32, its top k, renormalised to sum to 1 if `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe_ref(x: torch.Tensor,  # [T, D]
                  router_logits: torch.Tensor,  # [T, E]
                  gate_up: torch.Tensor,  # [E, 2F, D]
                  down: torch.Tensor,  # [E, D, F]
                  top_k: int, renormalize: bool) -> torch.Tensor:  # [T, D]
    weights, ids = route(router_logits, top_k, renormalize)
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():  # ascending, as transformers adds them
        tokens, slot = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(x.dtype))
    return out


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of `ids` [T, k] (pair p = t * k + slot) sorted by expert,
    each expert's run padded to a multiple of `block_m` with the pair count T * k (no
    pair): `sorted_pairs` [R]; and each block of `block_m` rows' expert, -1 past the
    last run: `block_expert` [R / block_m]. R = T*k + E*(block_m - 1), rounded up to a
    block: sizes fixed by the shapes, no value read back to the host."""
    flat = ids.flatten()
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # pairs, by expert, in pair order
    experts = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[experts]
    rows = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((rows,), n, dtype=torch.long, device=device)
    sorted_pairs[(run_end - padded)[experts] + rank] = order
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(run_end, block_start, right=True)
    return sorted_pairs, torch.where(block_expert < num_experts, block_expert, -1)


def route_fused(router_logits: torch.Tensor, top_k: int, renormalize: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` in one kernel (a program per token): the same weights and experts, but the
    k experts in order of weight with ties to the lower id, where topk's order of ties is
    its own."""
    t, e = router_logits.shape
    weights = torch.empty((t, top_k), dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.long, device=router_logits.device)
    if t:
        _route_kernel[(t,)](router_logits, weights, ids, router_logits.stride(0), e,
                            K=top_k, K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                            BLOCK_E=triton.next_power_of_2(e))
    return weights, ids


def fused_moe(x: torch.Tensor,  # [T, D], unit last stride
              router_logits: torch.Tensor,  # [T, E]
              gate_up: torch.Tensor,  # [E, 2F, D] contiguous
              down: torch.Tensor,  # [E, D, F] contiguous
              top_k: int, renormalize: bool,
              tile: dict[str, int] | None = None) -> torch.Tensor:  # [T, D]
    """`tile`: the grouped GEMM's, at any token count (benchmarks compare them);
    default: a row per pair for a few tokens, else `tiles`."""
    assert triton is not None, "Triton is not installed"
    t, d = x.shape
    e, two_f, _ = gate_up.shape
    weights, ids = route_fused(router_logits, top_k, renormalize)
    if tile is None and t * top_k <= e // 2:  # a few tokens: a row per pair, no sorting
        h = torch.empty((t * top_k, two_f), dtype=x.dtype, device=x.device)
        _pair_gemv(x, gate_up, h, None, ids, top_k)
        act = silu_mul(h)
        y = torch.empty((t * top_k, d), dtype=x.dtype, device=x.device)
        _pair_gemv(act, down, y, weights, ids, 1)
        return _sum_pairs(y, t, top_k)
    tile = tile or tiles(t * top_k, e)
    sorted_pairs, block_expert = align(ids, e, tile["BLOCK_M"])
    h = torch.empty((t * top_k, two_f), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, h, None, sorted_pairs, block_expert, top_k, tile)
    act = silu_mul(h)
    y = torch.empty((t * top_k, d), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, down, y, weights.flatten(), sorted_pairs, block_expert, 1, tile)
    return _sum_pairs(y, t, top_k)


def _sum_pairs(y: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """[T * k, D] -> [T, D]: each token's k rows summed in fp32 in slot order, in one
    kernel (torch's `.float().sum(1).to(dtype)` is three, and writes the rows out in fp32
    first: 97 + 46 + 6 us a layer of a 2,048-token Qwen3-30B-A3B prefill on an H200,
    2.7 + 4.2 + 1.0 us at one token)."""
    d = y.shape[1]
    out = torch.empty((t, d), dtype=y.dtype, device=y.device)
    if t:
        block = min(1024, triton.next_power_of_2(d))
        _sum_pairs_kernel[(t, triton.cdiv(d, block))](y, out, d, y.stride(0), out.stride(0),
                                                      K=k, BLOCK=block, num_warps=4)
    return out


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                  weights: torch.Tensor | None, sorted_pairs: torch.Tensor,
                  block_expert: torch.Tensor, rows_per_a: int, tile: dict[str, int]) -> None:
    """c[p] = a[p // rows_per_a] @ b[expert(p)].T (times weights[p]), for every pair p
    in `sorted_pairs` (blocks of `tile["BLOCK_M"]` rows, as `align` made them)."""
    n, k = b.shape[1], b.shape[2]
    block_n = min(tile["BLOCK_N"], max(16, triton.next_power_of_2(n)))
    block_k = min(tile["BLOCK_K"], max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_pairs, block_expert,
        c.shape[0], n, k, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        ROWS_PER_A=rows_per_a, WEIGHTED=weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=tile["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"])


def _pair_gemv(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               weights: torch.Tensor | None, ids: torch.Tensor, rows_per_a: int) -> None:
    """c[p] = a[p // rows_per_a] @ b[ids.flat[p]].T (times weights.flat[p]), a program
    per pair and block of columns."""
    n, k = b.shape[1], b.shape[2]
    # A sweep on an H200, Qwen3-30B-A3B's experts at one token (48 layers of distinct
    # weights in a CUDA graph; 8, 16 or 32 rows, 256-1,024 columns, 4 or 8 warps, 2 or 3
    # stages): gate_up (K 2,048) 726 us with 8 x 1,024 tiles against 931 with 32 x 256
    # (its bytes 577); down (K 768) 425 with 16 x 256 at 8 warps against 476 (bytes 288).
    long = k >= 1024
    block_n = min(8 if long else 16, triton.next_power_of_2(n))
    block_k = min(1024 if long else 256, max(16, triton.next_power_of_2(k)))
    grid = (ids.numel(), triton.cdiv(n, block_n))
    _pair_gemv_kernel[grid](
        a, b, c, weights if weights is not None else c, ids, n, k, a.stride(0), b.stride(0),
        b.stride(1), c.stride(0), ROWS_PER_A=rows_per_a, WEIGHTED=weights is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if long else 8, num_stages=3)


if triton is not None:

    @triton.jit
    def _route_kernel(logits, weights, ids, row, e, K: tl.constexpr, K_POW2: tl.constexpr,
                      RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        x = tl.load(logits + t * row + cols, mask=cols < e, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(cols < e, p / tl.sum(p, 0), -1.0)
        slots = tl.arange(0, K_POW2)
        picked_w = tl.zeros((K_POW2,), dtype=tl.float32)
        picked = tl.zeros((K_POW2,), dtype=tl.int64)
        for j in tl.static_range(K):  # the largest left, ties to the lower id
            best = tl.max(p, 0)
            pick = tl.min(tl.where(p == best, cols, BLOCK_E), 0)
            picked_w = tl.where(slots == j, best, picked_w)
            picked = tl.where(slots == j, pick.to(tl.int64), picked)
            p = tl.where(cols == pick, -1.0, p)
        if RENORMALIZE:
            picked_w = picked_w / tl.sum(picked_w, 0)  # the unused slots hold 0
        tl.store(weights + t * K + slots, picked_w.to(weights.dtype.element_ty),
                 mask=slots < K)
        tl.store(ids + t * K + slots, picked, mask=slots < K)

    @triton.jit
    def _sum_pairs_kernel(y, out, d, y_row, out_row, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < d
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(y + (t * K + j) * y_row + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + t * out_row + cols, acc.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _pair_gemv_kernel(a, b, c, weights, ids, n, k, a_row, b_expert, b_row, c_row,
                          ROWS_PER_A: tl.constexpr, WEIGHTED: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        expert = tl.load(ids + pair).to(tl.int64)
        a_ptr = a + (pair // ROWS_PER_A) * a_row
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a_ptr + ks, mask=ks < k, other=0.0).to(tl.float32)
            w = tl.load(b + expert * b_expert + cols[:, None] * b_row + ks[None, :],
                        mask=(cols[:, None] < n) & (ks[None, :] < k), other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
        if WEIGHTED:
            acc = acc * tl.load(weights + pair).to(tl.float32)
        tl.store(c + pair * c_row + cols, acc.to(c.dtype.element_ty), mask=cols < n)

    @triton.jit
    def _grouped_gemm_kernel(a, b, c, weights, sorted_pairs, block_expert, num_pairs, n, k,
                             a_row, b_expert, b_row, c_row, ROWS_PER_A: tl.constexpr,
                             WEIGHTED: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        block = tl.program_id(0)
        expert = tl.load(block_expert + block).to(tl.int64)
        if expert < 0:
            return  # past the last expert's run
        pairs = tl.load(sorted_pairs + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        a_rows = (pairs // ROWS_PER_A).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a_tile = tl.load(a + a_rows[:, None] * a_row + ks[None, :],
                             mask=valid[:, None] & (ks[None, :] < k), other=0.0)
            b_tile = tl.load(b + expert * b_expert + cols[None, :] * b_row + ks[:, None],
                             mask=(cols[None, :] < n) & (ks[:, None] < k), other=0.0)
            if IEEE:
                acc += tl.dot(a_tile, b_tile, input_precision="ieee")
            else:
                acc += tl.dot(a_tile, b_tile)
        if WEIGHTED:
            w = tl.load(weights + pairs, mask=valid, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        out = c + pairs.to(tl.int64)[:, None] * c_row + cols[None, :]
        tl.store(out, acc.to(c.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n))
