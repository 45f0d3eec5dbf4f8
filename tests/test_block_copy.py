"""The block gather/scatter kernel (kernels/block_copy.py) against its torch reference,
and the staging functions built on it (kvtransfer/staging.py)."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import assert_unchanged_except, clone, make_caches
from triton_interpreter import HAS_TRITON, run_under_interpreter

from tandem.kernels import block_copy
from tandem.kernels.block_copy import copy_blocks, copy_blocks_reference, plan_copy
from tandem.kvtransfer.staging import KVRows, gather_blocks, stack_layers


def compare_kernel_with_reference(device: str) -> None:
    """Triton kernel == torch reference for a gather, a scatter and a block-to-block copy,
    on shapes with a non-power-of-two block and more than one tile per block. Each copy
    runs twice: the second launch goes straight to the kernel compiled by the first."""
    g = torch.Generator().manual_seed(0)
    for dtype, elems in ((torch.bfloat16, 3 * 64 * 16), (torch.float32, 5000)):
        src = torch.randn(6, 20, elems, generator=g).to(dtype).to(device)
        ids = torch.tensor([17, 2, 9, 0, 11], device=device)
        other = torch.tensor([3, 19, 4, 8, 12], device=device)
        cases = [(src, ids, torch.zeros(6, 5, elems, dtype=dtype, device=device), None),
                 (src[:, :5], None, torch.zeros_like(src), ids),
                 (src, ids, torch.zeros_like(src), other)]
        for s, s_ids, d, d_ids in cases * 2:
            d.zero_()
            ref = d.clone()
            copy_blocks_reference(s, s_ids, ref, d_ids)
            copy_blocks(s, s_ids, d, d_ids, use_triton=True)
            assert torch.equal(d, ref), (dtype, elems, s_ids, d_ids)
        # Guarded: only the blocks whose tag holds the ticket are written.
        tags = torch.zeros(20, dtype=torch.int32, device=device)
        tags[other[[0, 2, 4]]], tags[other[1]] = 7, 8
        for ticket, written in ((7, [0, 2, 4]), (8, [1]), (7, [0, 2, 4])):
            ref, d = torch.zeros_like(src), torch.zeros_like(src)
            copy_blocks_reference(src, ids, ref, other, (tags, ticket))
            copy_blocks(src, ids, d, other, (tags, ticket), use_triton=True)
            assert torch.equal(d, ref), (dtype, elems, "guarded", ticket)
            assert torch.equal(ref[:, other[written]], src[:, ids[written]])
            assert not ref.index_fill_(1, other[written], 0).any()
        # A ticket per block (the sinks of several requests in one copy): block i is
        # written where its own ticket is its destination's tag.
        tickets = torch.tensor([7, 8, 5, 8, 7], dtype=torch.int32, device=device)
        ref, d = torch.zeros_like(src), torch.zeros_like(src)
        copy_blocks_reference(src, ids, ref, other, (tags, tickets))
        copy_blocks(src, ids, d, other, (tags, tickets), use_triton=True)
        assert torch.equal(d, ref), (dtype, elems, "tickets")
        written = [0, 1, 4]  # tags[other]: 7, 8, 7, 0, 7
        assert torch.equal(ref[:, other[written]], src[:, ids[written]])
        assert not ref.index_fill_(1, other[written], 0).any()
        # Planned once, launched twice: the tags are read at each launch.
        d = torch.zeros_like(src)
        copy = plan_copy(src, ids, d, other, (tags, 7), use_triton=True)
        copy()
        assert torch.equal(d[:, other[[0, 2, 4]]], src[:, ids[[0, 2, 4]]])
        d.zero_()
        tags[other[0]] = 0
        copy()
        assert torch.equal(d[:, other[[2, 4]]], src[:, ids[[2, 4]]])
        assert not d.index_fill_(1, other[[2, 4]], 0).any()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_matches_reference_under_the_interpreter() -> None:
    run_under_interpreter(
        "from test_block_copy import compare_kernel_with_reference as c; c('cpu')"
    )


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA")
def test_triton_kernel_matches_reference_on_cuda() -> None:
    compare_kernel_with_reference("cuda")


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA")
def test_a_planned_copy_goes_through_triton_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """After its first launch a planned copy launches the compiled kernel directly, and
    that launch copies exactly what Triton's does."""
    through = []
    real = block_copy._Launch._through_triton
    monkeypatch.setattr(block_copy._Launch, "_through_triton",
                        lambda self: through.append(1) or real(self))
    src = torch.randn(3, 8, 700, device="cuda")
    ids = torch.tensor([5, 1, 6], device="cuda")
    dst = torch.zeros(3, 3, 700, device="cuda")
    copy = plan_copy(src, ids, dst, None, use_triton=True)
    for step in range(4):
        dst.zero_()
        ids.copy_(torch.tensor([step, 7 - step, 4], device="cuda"))
        copy()
        assert torch.equal(dst, src[:, ids]), step
    assert len(through) == 1


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_a_profilers_launch_hook_sends_launches_through_triton() -> None:
    """No one listening (recent Triton keeps an empty chain of hooks): launch directly; a
    hook set: through Triton, so the profiler hears of the launch."""
    import triton

    runtime = triton.knobs.runtime
    assert not block_copy._hooked()
    hook = runtime.launch_enter_hook

    def listen(metadata: object) -> None:
        pass

    if hasattr(hook, "add"):
        hook.add(listen)
        try:
            assert block_copy._hooked()
        finally:
            hook.remove(listen)
    else:
        runtime.launch_enter_hook = listen
        try:
            assert block_copy._hooked()
        finally:
            runtime.launch_enter_hook = hook
    assert not block_copy._hooked()


def test_reference_copies_exactly_the_named_blocks() -> None:
    """Each path of the torch reference (gather into a contiguous or a strided view,
    scatter, block to block, plain copy) against a copy written out block by block."""
    g = torch.Generator().manual_seed(1)
    src = torch.randn(4, 12, 40, generator=g).to(torch.bfloat16)
    ids, other = torch.tensor([7, 0, 11, 3]), torch.tensor([2, 9, 5, 10])
    strided = torch.zeros(4, 8, 40, dtype=torch.bfloat16)[:, ::2]
    cases = [(src, ids, torch.zeros(4, 4, 40, dtype=torch.bfloat16), None),
             (src, ids, strided, None),
             (src[:, :4], None, torch.zeros_like(src), other),
             (src, ids, torch.zeros_like(src), other),
             (src[:, :4], None, torch.zeros(4, 4, 40, dtype=torch.bfloat16), None)]
    for s, s_ids, d, d_ids in cases:
        want = d.clone()
        for i in range(4):
            want[:, i if d_ids is None else d_ids[i]] = s[:, i if s_ids is None else s_ids[i]]
        copy_blocks_reference(s, s_ids, d, d_ids)
        assert torch.equal(d, want), (s_ids, d_ids, d.is_contiguous())


def test_copy_rejects_views_it_cannot_take() -> None:
    a = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="does not copy into"):
        copy_blocks(a, None, torch.zeros(2, 4, 9), None)
    with pytest.raises(ValueError, match="block counts disagree"):
        copy_blocks(a, torch.tensor([0, 1]), torch.zeros(2, 3, 8), None)
    with pytest.raises(ValueError, match="contiguous"):
        copy_blocks(a, None, torch.zeros(2, 8, 4).transpose(1, 2), None)
    tags = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="3 tickets for 4 blocks"):
        copy_blocks(a, None, torch.zeros(2, 4, 8), None, (tags, torch.ones(3, dtype=torch.int32)))


def test_stack_layers_views_one_tensor_only() -> None:
    one = make_caches(8)
    stacked = stack_layers(one, 1, 3)
    assert stacked is not None and stacked.shape == (3, *one[0].shape)
    assert stacked.data_ptr() == one[1].data_ptr()
    assert all(torch.equal(stacked[i], one[1 + i]) for i in range(3))
    separate = make_caches(8, one_tensor=False)
    assert stack_layers(separate, 0, 2) is None
    assert stack_layers(separate, 2, 1) is not None  # one layer is always a view


@pytest.mark.parametrize("one_tensor", [True, False])
def test_gather_and_scatter_a_run_of_layers_exactly(one_tensor: bool) -> None:
    src = make_caches(12, torch.bfloat16, seed=1, num_layers=5, one_tensor=one_tensor)
    dst = make_caches(12, torch.bfloat16, seed=2, num_layers=5, one_tensor=one_tensor)
    before = clone(dst)
    src_ids, dst_ids = torch.tensor([7, 2, 11, 5]), [0, 9, 3, 10]
    staged = torch.empty(3, 2, 4, *src[0].shape[2:], dtype=torch.bfloat16)
    KVRows(src).gather(1, src_ids, staged)
    for i in range(3):
        assert torch.equal(staged[i], gather_blocks(src[1 + i], src_ids))
    KVRows(dst).scatter(1, torch.tensor(dst_ids), staged)
    for i in range(3):
        for s, d in zip(src_ids.tolist(), dst_ids):
            assert torch.equal(dst[1 + i][:, d], src[1 + i][:, s])
    assert torch.equal(dst[0], before[0]) and torch.equal(dst[-1], before[-1])
    assert_unchanged_except(before, dst, dst_ids)
