"""KVLayout (derivation, serialization, mismatch messages) and block gather/scatter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_helpers import MODEL, assert_unchanged_except, clone, make_caches

from tandem.kvtransfer.connector import TransferError
from tandem.kvtransfer.layout import KVLayout, LayoutMismatch
from tandem.kvtransfer.staging import _PinnedSlots, device_ids, gather_blocks, scatter_blocks


def test_layout_of_caches() -> None:
    layout = KVLayout.of(make_caches(10, torch.bfloat16), MODEL)
    assert layout == KVLayout(MODEL, "bfloat16", 4, 2, 8, 4)
    assert layout.torch_dtype is torch.bfloat16
    assert layout.block_bytes == 2 * 4 * 2 * 8 * 2  # K+V, tokens, heads, dim, bf16
    assert layout.staging_shape(3) == (2, 3, 4, 2, 8)
    assert KVLayout.from_dict(layout.to_dict()) == layout


def test_llama3_8b_block_bytes() -> None:
    layout = KVLayout("llama-3-8b", "bfloat16", 32, 8, 128, 16)
    # 2,048 tokens = 128 blocks over 32 layers ~ 268 MB.
    assert layout.block_bytes * 128 * 32 == 268_435_456


def test_layout_of_rejects_bad_caches() -> None:
    caches = make_caches(10)
    with pytest.raises(ValueError, match="layer 1"):
        KVLayout.of([caches[0], caches[1].to(torch.float16)], MODEL)
    with pytest.raises(ValueError, match=r"\[2, blocks, bs, H, D\]"):
        KVLayout.of([caches[0][0]], MODEL)
    with pytest.raises(TransferError, match="unknown dtype"):
        KVLayout(MODEL, "float33", 4, 2, 8, 4)


def test_check_names_every_differing_field_with_both_values() -> None:
    ours = KVLayout(MODEL, "bfloat16", 32, 8, 128, 16)
    ours.check(dataclasses.replace(ours))
    theirs = dataclasses.replace(ours, dtype="float16", num_kv_heads=4, model_id="other")
    with pytest.raises(LayoutMismatch) as info:
        ours.check(theirs)
    msg = str(info.value)
    assert "model_id: 'test-model' here vs 'other' there" in msg
    assert "dtype: 'bfloat16' here vs 'float16' there" in msg
    assert "num_kv_heads: 8 here vs 4 there" in msg
    for same in ("num_layers", "head_dim", "block_size"):
        assert same not in msg
    assert isinstance(info.value, TransferError)


def test_from_dict_names_missing_fields() -> None:
    d = KVLayout(MODEL, "float32", 4, 2, 8, 4).to_dict()
    del d["head_dim"], d["block_size"]
    with pytest.raises(LayoutMismatch, match=r"\['block_size', 'head_dim'\]"):
        KVLayout.from_dict(d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_is_contiguous_and_exact(dtype: torch.dtype) -> None:
    (cache,) = make_caches(12, dtype, num_layers=1)
    ids = [7, 2, 11, 5]
    staged = gather_blocks(cache, ids)
    assert staged.shape == (2, 4, 4, 2, 8) and staged.is_contiguous()
    for i, b in enumerate(ids):
        assert torch.equal(staged[:, i], cache[:, b])
    # Reusing a staging buffer gives the same bytes in the same memory.
    out = torch.empty_like(staged)
    assert gather_blocks(cache, torch.tensor(ids), out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, staged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_writes_only_its_blocks(dtype: torch.dtype) -> None:
    src = make_caches(12, dtype, seed=1, num_layers=1)[0]
    dst = make_caches(12, dtype, seed=2, num_layers=1)
    before = clone(dst)
    sink_ids = [7, 2, 11, 5]
    scatter_blocks(dst[0], sink_ids, gather_blocks(src, [0, 1, 2, 3]))
    for i, b in enumerate(sink_ids):
        assert torch.equal(dst[0][:, b], src[:, i])
    assert_unchanged_except(before, dst, sink_ids)


def test_scatter_rejects_a_staged_buffer_that_does_not_fit() -> None:
    (cache,) = make_caches(12, num_layers=1)
    staged = gather_blocks(cache, [0, 1, 2])
    with pytest.raises(ValueError, match="does not fit 2 blocks"):
        scatter_blocks(cache, [4, 5], staged)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_blocks(cache, [4, 5, 6], staged.to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_ids_reach_the_device_exact_through_reused_pinned_slots() -> None:
    """`device_ids` on CUDA copies from a thread's few pinned slots, each written again
    only once its last copy is done: with the stream held up by a long kernel, more
    lists than there are slots each land exact, and so do those after a longer one grew
    the slots, and one longer than they grow to."""
    device = torch.device("cuda")
    big = torch.randn(4096, 4096, device=device)
    for _ in range(20):  # the copies queue behind these
        big = big @ big / 64
    lists = [([i, i + 1, 3 * i], [7 * i, i, 0]) for i in range(3 * _PinnedSlots.SLOTS)]
    lists.append((list(range(_PinnedSlots.IDS)), list(range(_PinnedSlots.IDS, 0, -1))))
    lists += lists[:2 * _PinnedSlots.SLOTS]  # in the grown slots
    most = _PinnedSlots.MAX_IDS // 2 + 1  # past the most a slot grows to: pinned alone
    lists.append((list(range(most)), list(range(most, 0, -1))))
    out = [device_ids(*ids, device=device) for ids in lists]
    for ids, got in zip(lists, out, strict=True):
        assert got.device.type == "cuda" and got.tolist() == [list(ids[0]), list(ids[1])]
