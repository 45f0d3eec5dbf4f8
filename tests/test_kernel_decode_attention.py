"""The decode attention kernel (kernels/decode_attention.py) against its torch reference
and the engine's paged_attention_ref, on random paged caches.

Run as a script on a GPU it prints the kernel's KV read bandwidth instead:
`.venv/bin/python tests/test_kernel_decode_attention.py`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_interpreter import HAS_TRITON, run_under_interpreter

from tandem.kernels import decode_attention as kernel_module
from tandem.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)
from tandem.kernels.paged_attention import paged_attention_ref

PAGE = 16
# Lengths either side of page boundaries, the first a lone token.
MIXED = [1, 15, 16, 17, 33, 100]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def make_inputs(lens: list[int], group: int, head_dim: int, kv_heads: int,
                dtype: torch.dtype, device: str, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, kv_cache, block_tables, seq_lens: each sequence's pages are distinct blocks in
    shuffled order, and its table row continues with random block ids."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lens]
    num_blocks = sum(pages) + 3  # a few blocks nobody owns
    width = max(pages) + 2
    kv_cache = torch.randn(2, num_blocks, PAGE, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), group * kv_heads, head_dim, generator=g).to(dtype)
    tables = make_tables(lens, num_blocks, width, g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q.to(device), kv_cache.to(device), tables.to(device), seq_lens.to(device)


def make_tables(lens: list[int], num_blocks: int, width: int,
                g: torch.Generator) -> torch.Tensor:
    """[B, width] int32: distinct shuffled blocks for the pages, random ids after them."""
    pages = [-(-n // PAGE) for n in lens]
    tables = torch.randint(0, num_blocks, (len(lens), width), generator=g, dtype=torch.int32)
    owned = torch.randperm(num_blocks, generator=g).to(torch.int32)[: sum(pages)].split(pages)
    for row, ids in zip(tables, owned):
        row[: len(ids)] = ids
    return tables


def cases(device: str) -> list[tuple[torch.dtype, int, int, int, list[int], int]]:
    """(dtype, group, head_dim, kv_heads, lens, num_splits). The interpreter is slow and
    computes bfloat16 tl.dot on the raw bits (triton-lang/triton#11584), so on CPU: a few
    float32/float16 cases; on CUDA every dtype x group x head dim, longer contexts too."""
    if device == "cpu":
        return [(torch.float32, 4, 64, 2, MIXED, 1),
                (torch.float16, 3, 128, 1, MIXED, 3),
                (torch.float16, 8, 64, 1, [17], 8),  # 2 pages, 8 splits
                (torch.float32, 1, 128, 2, MIXED[::-1], 8)]
    out = []
    combos = itertools.product((torch.float32, torch.bfloat16, torch.float16), (1, 3, 4, 8),
                               (64, 128))
    for i, (dtype, group, dim) in enumerate(combos):
        splits = (1, 3, 8)[i % 3]
        out.append((dtype, group, dim, 2, [*MIXED, 1000, 2049], splits))
        out.append((dtype, group, dim, 1, [33], 8))  # 3 pages, 8 splits
    return out


def compare(device: str) -> None:
    """Kernel == reference (within the dtype's tolerance) on each case, and == the engine's
    paged_attention_ref on one; the output lands in `out` when one is passed."""
    for i, (dtype, group, dim, kv_heads, lens, splits) in enumerate(cases(device)):
        q, kv_cache, tables, seq_lens = make_inputs(lens, group, dim, kv_heads, dtype,
                                                    device, seed=i)
        want = decode_attention_ref(q, kv_cache, tables, seq_lens, dim**-0.5)
        got = decode_attention(q, kv_cache, tables, seq_lens, dim**-0.5, splits)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                   msg=lambda m, c=(dtype, group, dim, lens, splits): f"{c}: {m}")
    # Sliding windows (shorter than a page, across pages, past every context) and
    # soft-capped scores, with one split and several; against the engine's reference too.
    for i, (window, softcap, splits) in enumerate(((5, 0.0, 1), (21, 0.0, 3), (1000, 0.0, 2),
                                                   (0, 0.5, 3), (13, 0.7, 4))):
        q, kv_cache, tables, seq_lens = make_inputs(MIXED, 3, 64, 2, torch.float32, device,
                                                    seed=50 + i)
        want = decode_attention_ref(q, kv_cache, tables, seq_lens, 0.125, window, softcap)
        got = decode_attention(q, kv_cache, tables, seq_lens, 0.125, splits, window=window,
                               softcap=softcap)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, c=(window, softcap, splits): f"{c}: {m}")
        engine = paged_attention_ref(q, kv_cache, tables.long(), MIXED,
                                     list(range(len(MIXED) + 1)), 0.125, window=window or None,
                                     softcap=softcap or None)
        torch.testing.assert_close(want, engine, atol=1e-5, rtol=1e-5)
    q, kv_cache, tables, seq_lens = make_inputs(MIXED, 4, 64, 2, torch.float32, device, seed=99)
    out = torch.empty_like(q)
    got = decode_attention(q, kv_cache, tables, seq_lens, 0.125, 3, out=out)
    assert got is out
    engine = paged_attention_ref(q, kv_cache, tables.long(), MIXED,
                                 list(range(len(MIXED) + 1)), 0.125)
    torch.testing.assert_close(out, engine, atol=1e-5, rtol=1e-5)


def replay_in_cuda_graph() -> None:
    """Captured once, replayed after the lengths and tables change in place: the launch
    reads them on the device, so the graph stays right."""
    lens, later = [100, 1, 33, 2049], [17, 700, 16, 1500]  # 141 of the 143 blocks
    q, kv_cache, tables, seq_lens = make_inputs(lens, 4, 128, 2, torch.bfloat16, "cuda", 0)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        decode_attention(q, kv_cache, tables, seq_lens, 0.1, 5, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, kv_cache, tables, seq_lens, 0.1, 5, out=out)
    g = torch.Generator().manual_seed(1)
    for lens_now in (lens, later):
        tables.copy_(make_tables(lens_now, kv_cache.shape[1], tables.shape[1], g))
        seq_lens.copy_(torch.tensor(lens_now, dtype=torch.int32))
        graph.replay()
        want = decode_attention_ref(q, kv_cache, tables, seq_lens, 0.1)
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_matches_reference_under_the_interpreter() -> None:
    run_under_interpreter("from test_kernel_decode_attention import compare; compare('cpu')")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA")
def test_kernel_matches_reference_on_cuda() -> None:
    compare("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA")
def test_kernel_replays_in_a_cuda_graph() -> None:
    replay_in_cuda_graph()


def test_choose_num_splits() -> None:
    assert choose_num_splits(128, 8, 512, 16, 132) == 1  # 1,024 programs fill the GPU
    assert choose_num_splits(16, 8, 512, 16, 132) == 3  # 128 programs: 3 x 128 >= 264
    assert choose_num_splits(1, 8, 8192, 16, 132) == 33
    assert choose_num_splits(1, 8, 100, 16, 132) == 7  # one page each
    assert choose_num_splits(1, 1, 1 << 20, 16, 132) == 64  # the cap
    assert choose_num_splits(1, 8, 1, 16, 132) == 1


def test_reference_on_a_hand_computed_case() -> None:
    """Two tokens in block 1 (block 0 is garbage): softmax over the two scores."""
    kv_cache = torch.zeros(2, 2, PAGE, 1, 2)
    kv_cache[:, 0] = 100.0
    kv_cache[0, 1, :2, 0] = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    kv_cache[1, 1, :2, 0] = torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    q = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # two query heads share kv head 0
    out = decode_attention_ref(q, kv_cache, torch.tensor([[1, 0]]), torch.tensor([2]), 1.0)
    w = torch.tensor(1.0).exp() / (torch.tensor(1.0).exp() + 1)
    torch.testing.assert_close(out[0, 0], torch.stack([2 * w, 4 * (1 - w)]))
    torch.testing.assert_close(out[0, 1], torch.tensor([1.0, 2.0]))


def test_the_engines_reference_attends_each_row_over_its_own_context() -> None:
    """paged_attention_ref's decode rows, in length groups (long, short and in between,
    a prompt's rows among them), each as decode_attention_ref attends that row alone."""
    lens = [1800, 40, 700, 3, 1200, 520, 1, 90]
    q, kv_cache, tables, seq_lens = make_inputs(lens, 3, 64, 2, torch.float32, "cpu", 7)
    want = torch.cat([decode_attention_ref(q[b:b + 1], kv_cache, tables[b:b + 1],
                                           seq_lens[b:b + 1], 0.125) for b in range(len(lens))])
    got = paged_attention_ref(q, kv_cache, tables.long(), lens, list(range(len(lens) + 1)),
                              0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Sequence 2's last 4 tokens as a prompt chunk: the other rows keep their answers.
    chunk = torch.randn(4, *q.shape[1:], generator=torch.Generator().manual_seed(8))
    mixed_q = torch.cat([q[:2], chunk, q[3:]])
    starts = [0, 1, 2, 6, *range(7, len(lens) + 4)]
    mixed = paged_attention_ref(mixed_q, kv_cache, tables.long(), lens, starts, 0.125)
    alone = paged_attention_ref(chunk, kv_cache, tables[2:3].long(), [700], [0, 4], 0.125)
    torch.testing.assert_close(mixed[2:6], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([mixed[:2], mixed[6:]]),
                               torch.cat([want[:2], want[3:]]), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_wrapper_rejects_layouts_it_cannot_take() -> None:
    q, kv_cache, tables, seq_lens = make_inputs([17], 4, 64, 2, torch.float32, "cpu", 0)
    with pytest.raises(AssertionError):
        decode_attention(q, kv_cache, tables.long(), seq_lens, 0.125)  # int64 tables
    with pytest.raises(AssertionError):
        decode_attention(q, kv_cache, tables, seq_lens.long(), 0.125)
    with pytest.raises(AssertionError):
        decode_attention(q.half(), kv_cache, tables, seq_lens, 0.125)
    with pytest.raises(AssertionError):
        decode_attention(q[..., :48], kv_cache[..., :48], tables, seq_lens, 0.125)
    with pytest.raises(AssertionError):  # 8 query heads over 3 kv heads
        decode_attention(q, torch.zeros(2, 4, PAGE, 3, 64), tables, seq_lens, 0.125)


def bench() -> None:
    """KV bytes read per second at Llama-3-8B shapes (Hq 32, Hkv 8, D 128, bf16), for each
    tile size, stage count, warp count and split count, timed in CUDA graphs (no launch
    overhead). Small cases run over several caches in turn, more bytes than L2 holds, so
    the reads come from HBM. Prints every setting, then the fastest few per shape."""
    import triton

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, length in ((128, 512), (32, 2048), (1, 8192)):
        nbytes = batch * length * 8 * 128 * 2 * 2
        copies = -(-(256 << 20) // nbytes)
        inputs = [make_inputs([length] * batch, 4, 128, 8, torch.bfloat16, "cuda", seed)
                  for seed in range(copies)]
        chosen = choose_num_splits(batch, 8, length, PAGE, num_sms)
        results = []
        for splits, block_n, stages, warps in itertools.product(
                sorted({1, 2, chosen}), (64, 128), (2, 3, 4), (4, 8)):
            if block_n == 128 and stages == 4:
                continue  # beyond shared memory
            kernel_module._tile = lambda dtype, t=(block_n, stages): t  # noqa: ARG005
            kernel_module._NUM_WARPS = warps

            def run(splits: int = splits, inputs: list = inputs) -> None:
                for q, kv_cache, tables, seq_lens in inputs:
                    decode_attention(q, kv_cache, tables, seq_lens, 0.088, splits)

            us = triton.testing.do_bench_cudagraph(run) * 1e3 / copies
            name = (f"batch {batch} x {length} tokens, {splits} splits, BLOCK_N {block_n}, "
                    f"{stages} stages, {warps} warps")
            results.append((us, name))
            print(f"{name}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s", flush=True)
        for us, name in sorted(results)[:4]:
            print(f"best: {name}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s", flush=True)


if __name__ == "__main__":
    bench()
