"""The grouped-GEMM mixture of experts (`kernels/fused_moe.py`): its alignment of pairs to
experts, and the Triton kernel against the torch reference under Triton's interpreter
(the GPU run checks it in bf16)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import HAS_TRITON, run_under_interpreter

from tandem.kernels.fused_moe import align


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 2, 8), (37, 2, 6), (50, 3, 16)])
def test_align_puts_each_pair_once_in_its_experts_blocks(tokens: int, top_k: int,
                                                         experts: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    sorted_pairs, block_expert = align(ids, experts, block_m=4)
    n = tokens * top_k
    assert sorted_pairs.numel() == block_expert.numel() * 4 >= n + experts * 3
    real = sorted_pairs[sorted_pairs < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair once
    assert (sorted_pairs[sorted_pairs >= n] == n).all()  # the rest is padding
    flat = ids.flatten()
    for block, expert in enumerate(block_expert.tolist()):
        rows = sorted_pairs[block * 4:(block + 1) * 4]
        rows = rows[rows < n]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == expert).all()
    used = block_expert[block_expert >= 0]
    assert (used[1:] >= used[:-1]).all()  # runs in expert order
    assert set(used.tolist()) == set(flat.tolist())  # an expert nobody chose has no block


def compare() -> None:
    """Run under TRITON_INTERPRET=1: the one-kernel routing against `route`, and fused_moe
    against fused_moe_ref, fp32, on shapes that leave experts unchosen and blocks
    part-full, a row per pair (fewer pairs than half the experts) and sorted."""
    from tandem.kernels.fused_moe import fused_moe, fused_moe_ref, route, route_fused

    g = torch.Generator().manual_seed(0)
    for t, e, k, renorm in ((5, 8, 2, True), (3, 128, 8, True), (4, 6, 3, False)):
        logits = torch.randn(t, e, generator=g)
        want_w, want_ids = route(logits, k, renorm)
        got_w, got_ids = route_fused(logits, k, renorm)
        assert torch.equal(got_ids, want_ids), (got_ids, want_ids)  # no ties: same order
        assert torch.allclose(got_w, want_w, rtol=1e-6, atol=1e-7), (got_w, want_w)
    for t, d, f, e, k, renorm in ((1, 32, 48, 8, 2, True), (2, 32, 24, 16, 3, False),
                                  (37, 40, 24, 6, 2, False), (20, 64, 32, 16, 4, True)):
        x = torch.randn(t, d, generator=g)
        logits = torch.randn(t, e, generator=g)
        gate_up = torch.randn(e, 2 * f, d, generator=g) / d**0.5
        down = torch.randn(e, d, f, generator=g) / f**0.5
        got = fused_moe(x, logits, gate_up, down, k, renorm)
        want = fused_moe_ref(x, logits, gate_up, down, k, renorm)
        assert got.shape == want.shape and got.dtype == want.dtype
        err = (got - want).abs().max().item()
        assert err < 1e-4 * max(1.0, want.abs().max().item()), (t, d, f, e, k, err)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fused_moe_matches_the_reference_under_the_interpreter() -> None:
    run_under_interpreter("from test_fused_moe import compare; compare()")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_the_reference_on_the_gpu(dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B's expert shape (128 experts of 768, 8 a token) at 1, 300 and 2,048 tokens."""
    from tandem.kernels.fused_moe import fused_moe, fused_moe_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    d, f, e, k = 2048, 768, 128, 8
    gate_up = (torch.randn(e, 2 * f, d, generator=g, device="cuda") / d**0.5).to(dtype)
    down = (torch.randn(e, d, f, generator=g, device="cuda") / f**0.5).to(dtype)
    for t in (1, 300, 2048):  # a decode step, and prefills (the tensor-core tiles)
        x = torch.randn(t, d, generator=g, device="cuda").to(dtype)
        logits = torch.randn(t, e, generator=g, device="cuda").to(dtype)
        got = fused_moe(x, logits, gate_up, down, k, True).float()
        want = fused_moe_ref(x, logits, gate_up, down, k, True).float()
        scale = want.abs().max().item()
        tol = 2e-3 if dtype == torch.float32 else 3e-2  # tf32-free fp32; bf16 roundings
        assert (got - want).abs().max().item() <= tol * scale, (t, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_moe_replays_in_a_cuda_graph() -> None:
    """A decode step's experts in a CUDA graph (as the engine captures them): replayed on
    new tokens and routing, it equals the reference of those, so nothing of the capture's
    routing was baked in or read back to the host."""
    from tandem.kernels.fused_moe import fused_moe, fused_moe_ref

    g = torch.Generator(device="cuda").manual_seed(1)
    t, d, f, e, k = 8, 2048, 768, 128, 8
    gate_up = (torch.randn(e, 2 * f, d, generator=g, device="cuda") / d**0.5).bfloat16()
    down = (torch.randn(e, d, f, generator=g, device="cuda") / f**0.5).bfloat16()
    x = torch.randn(t, d, generator=g, device="cuda").bfloat16()
    logits = torch.randn(t, e, generator=g, device="cuda").bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels outside the capture
        fused_moe(x, logits, gate_up, down, k, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, logits, gate_up, down, k, True)
    for _ in range(3):
        x.copy_(torch.randn(t, d, generator=g, device="cuda"))
        logits.copy_(torch.randn(t, e, generator=g, device="cuda"))
        graph.replay()
        want = fused_moe_ref(x, logits, gate_up, down, k, True).float()
        assert (out.float() - want).abs().max().item() <= 3e-2 * want.abs().max().item()
