"""The prefill attention kernel (kernels/prefill_attention.py) against its torch reference,
and that reference against the engine's (kernels/paged_attention.py)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import HAS_TRITON, run_under_interpreter

from tandem.kernels.paged_attention import paged_attention_ref
from tandem.kernels.prefill_attention import prefill_attention, prefill_attention_ref

PAGE = 16
# fp32: the interpreter's numpy dots sum in an order that follows the host's BLAS kernels;
# one CI host missed 1e-5 by 2.7e-6 on a soft-capped row. A kernel that reads a poisoned
# slot or a wrong page misses by whole units.
TOLERANCE = {torch.float32: 3e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# (context length, new tokens): a chunk after a cached prefix crossing page boundaries,
# decode rows, a fresh prompt, a q_len 0 row in the middle and at the end.
MIXED = [(37, 20), (23, 1), (19, 19), (30, 0), (16, 1), (40, 7), (9, 0)]


def make_batch(lens: list[tuple[int, int]], hq: int, hkv: int, dim: int,
               dtype: torch.dtype, device: str, g: torch.Generator, poison: bool = True
               ) -> tuple[torch.Tensor, ...]:
    """q, kv_cache, block_tables, seq_lens, query_start. Pages are shuffled over a cache
    twice the size needed; the entries past each row's valid ones name unused pages.
    With `poison`, unused pages and the slots past each context are NaN: a kernel that
    reads one shows it in its output."""
    need = [-(-length // PAGE) for length, _ in lens]
    num_blocks = 2 * sum(need) + 2
    width = max(need) + 2
    ids = torch.randperm(num_blocks, generator=g)
    used, spare = ids[: sum(need)].split(need), ids[sum(need):]
    kv = torch.randn(2, num_blocks, PAGE, hkv, dim, generator=g)
    tables = spare[torch.randint(len(spare), (len(lens), width), generator=g)]
    for b, ((length, _), pages) in enumerate(zip(lens, used)):
        tables[b, : len(pages)] = pages
        if poison and length % PAGE:
            kv[:, pages[-1], length % PAGE:] = float("nan")
    if poison:
        kv[:, spare] = float("nan")
    q_lens = [n for _, n in lens]
    q = torch.randn(sum(q_lens), hq, dim, generator=g)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    return (q.to(dtype).to(device), kv.to(dtype).to(device),
            tables.to(torch.int32).to(device),
            torch.tensor([length for length, _ in lens], dtype=torch.int32, device=device),
            starts.to(torch.int32).to(device))


def check(lens: list[tuple[int, int]], hq: int, hkv: int, dim: int, dtype: torch.dtype,
          device: str, g: torch.Generator, extra_tiles: int = 0, window: int = 0,
          softcap: float = 0.0) -> None:
    q, kv, tables, seq_lens, starts = make_batch(lens, hq, hkv, dim, dtype, device, g)
    scale = dim ** -0.5
    want = prefill_attention_ref(q, kv, tables, seq_lens, starts, scale, window, softcap)
    # Two rows past T catch a q_len 0 row at the end that writes.
    buf = torch.full((q.shape[0] + 2, hq, dim), 7.0, dtype=dtype, device=device)
    max_q = max(n for _, n in lens) + extra_tiles
    got = prefill_attention(q, kv, tables, seq_lens, starts, max_q, scale, out=buf[:-2],
                            window=window, softcap=softcap)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[-2:], torch.full_like(buf[-2:], 7.0))
    tol = TOLERANCE[dtype]
    assert not want.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                               msg=lambda m: f"{lens} {hq}/{hkv} D{dim} {dtype} "
                                             f"window {window} cap {softcap}: {m}")


def compare(device: str) -> None:
    """Triton kernel == torch reference over GQA ratios 1/3/4/8, head dims 64 and 128,
    fp32/fp16 (and bf16 on CUDA), on a mixed batch; on CUDA also Llama-3-8B heads at
    lengths that span several of the production tiles, and one 16k-token prompt."""
    g = torch.Generator().manual_seed(0)
    # Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton
    # #11584, not supported there): bf16 is checked on CUDA only.
    dtypes = [d for d in TOLERANCE if device == "cuda" or d != torch.bfloat16]
    cases = [(dtype, dim, groups) for dtype in dtypes for dim in (64, 128)
             for groups in (1, 3, 4, 8)]
    for i, (dtype, dim, groups) in enumerate(cases):
        hkv = 2 if groups < 4 else 1
        check(MIXED, groups * hkv, hkv, dim, dtype, device, g, extra_tiles=i % 2)
    # Sliding windows shorter than a tile, across tiles, and longer than every context;
    # soft-capped scores (scaled up so the cap bites), alone and with a window.
    for dtype in dtypes:
        for window, softcap in ((5, 0.0), (21, 0.0), (1000, 0.0), (0, 0.5), (13, 0.7)):
            check(MIXED, 6, 2, 64, dtype, device, g, window=window, softcap=softcap)
    if device != "cuda":
        return
    long = [(700, 600), (300, 300), (1000, 1), (129, 65), (64, 0), (2048, 2048)]
    for dtype in TOLERANCE:
        check(long, 32, 8, 128, dtype, device, g)
        check(long, 12, 4, 64, dtype, device, g, extra_tiles=100)
    check([(16384, 16384)], 2, 1, 128, torch.bfloat16, device, g)
    check(long, 8, 4, 256, torch.bfloat16, device, g, window=1024, softcap=50.0)  # Gemma


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_matches_reference_under_the_interpreter() -> None:
    run_under_interpreter(
        "from test_kernel_prefill_attention import compare; compare('cpu')", timeout=600
    )


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA")
def test_kernel_matches_reference_on_cuda() -> None:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is exact too
    try:
        compare("cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_reference_matches_the_engine_reference() -> None:
    """Same numbers as paged_attention_ref on a mixed batch (no NaN: the engine's decode
    path reads padded pages and masks them)."""
    g = torch.Generator().manual_seed(1)
    q, kv, tables, seq_lens, starts = make_batch(MIXED, 8, 2, 64, torch.float32, "cpu", g,
                                                 poison=False)
    want = paged_attention_ref(q, kv, tables.long(), seq_lens.tolist(), starts.tolist(),
                               0.125)
    got = prefill_attention_ref(q, kv, tables, seq_lens, starts, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for window, softcap in ((5, None), (None, 0.3), (9, 0.3)):
        want = paged_attention_ref(q, kv, tables.long(), seq_lens.tolist(), starts.tolist(),
                                   0.125, window=window, softcap=softcap)
        got = prefill_attention_ref(q, kv, tables, seq_lens, starts, 0.125, window or 0,
                                    softcap or 0.0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
