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
written at the pair's row; the k rows of a token are summed last.
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
    tiles, the largest once an expert's run fills them. Measured on an H200 with
    Qwen3-30B-A3B's experts (`benchmarks/moe_tiles.py`): at 1 to 64 tokens every small
    tile is within 1% of the best; at 2,048 tokens 128 x 256 x 64 was the best (0.81 ms a
    layer, 64 x 128 x 64 0.89)."""
    per_expert = pairs / experts
    if per_expert <= 4:
        return {"BLOCK_M": BLOCK_M, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                "num_stages": 3}
    if per_expert < 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}


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


def fused_moe(x: torch.Tensor,  # [T, D], unit last stride
              router_logits: torch.Tensor,  # [T, E]
              gate_up: torch.Tensor,  # [E, 2F, D] contiguous
              down: torch.Tensor,  # [E, D, F] contiguous
              top_k: int, renormalize: bool) -> torch.Tensor:  # [T, D]
    assert triton is not None, "Triton is not installed"
    t, d = x.shape
    e, two_f, _ = gate_up.shape
    weights, ids = route(router_logits, top_k, renormalize)
    tile = tiles(t * top_k, e)
    sorted_pairs, block_expert = align(ids, e, tile["BLOCK_M"])
    h = torch.empty((t * top_k, two_f), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, h, None, sorted_pairs, block_expert, top_k, tile)
    act = silu_mul(h)
    y = torch.empty((t * top_k, d), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, down, y, weights.flatten(), sorted_pairs, block_expert, 1, tile)
    return y.view(t, top_k, d).float().sum(1).to(x.dtype)


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


if triton is not None:

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
