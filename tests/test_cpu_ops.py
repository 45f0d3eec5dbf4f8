"""engine/cpu_ops.py's fused C++ ops against the torch references they stand for
(kernels/rms_norm.py, rope.py, silu_mul.py, kv_store.py + paged_attention.py) on random
inputs, and the fused attention backend keeping the reference where it must."""

from __future__ import annotations

import logging

import pytest
import torch
from test_kernels_small import inv_freq, random_qkv, split_qkv

from tandem.engine import cpu_build, cpu_ops
from tandem.engine.attention import AttentionMetadata
from tandem.engine.attention_torch import TorchAttention
from tandem.kernels.kv_store import store_kv_ref
from tandem.kernels.paged_attention import paged_attention_ref
from tandem.kernels.rms_norm import rms_norm_ref
from tandem.kernels.rope import apply_rope_ref_, rope_cache
from tandem.kernels.silu_mul import silu_mul_ref

pytestmark = pytest.mark.skipif(cpu_build.missing() is not None,
                                reason=f"engine/cpu_build.py {cpu_build.missing()}")

EPS = 1e-5
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu_build.unavailable() is None


def _ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, what: object) -> None:
    """Within `ulps` fp32 steps of the reference's magnitude (sums in another order, exp
    of its own), and of 2^-126 near zero."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, what
    bound = ulps * torch.finfo(torch.float32).eps * want.abs() + 2**-126
    assert torch.all((got - want).abs() <= bound), (what, (got - want).abs().max().item())


@pytest.mark.parametrize("t", [1, 7, 300])  # 300 rows: split between threads
@pytest.mark.parametrize("h", [576, 100])  # 100: a tail past the last whole vector
def test_rms_norm_matches_its_reference(t: int, h: int) -> None:
    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h + 3, generator=g)[:, :h]  # row stride h + 3
    w = 1 + 0.1 * torch.randn(h, generator=g)
    x_before = x.clone()
    _ulps(cpu_ops.rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), 8, (t, h))
    res = torch.randn(t, h + 1, generator=g)[:, :h]
    res_ref = res.clone()
    out, res_out = cpu_ops.rms_norm(x, w, EPS, res)
    want, _ = rms_norm_ref(x, w, EPS, res_ref)
    assert res_out is res
    assert torch.equal(res, res_ref)  # x + residual, rounded as torch's add
    _ulps(out, want, 8, (t, h, "residual"))
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 4, 1), (40, 2, 2)])  # 40: a tail
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("fused_qkv", [True, False])
def test_rope_is_its_reference_bit_for_bit(d: int, hq: int, hkv: int, t: int,
                                           fused_qkv: bool) -> None:
    """Each product and sum rounded as the reference's: equal, on a fused qkv's views
    (int32 positions, as the runner's) or on q and k apart (int64)."""
    g = torch.Generator().manual_seed(t * d)
    cache = rope_cache(inv_freq(d), 4096)
    qkv = random_qkv(t, hq, hkv, d, torch.float32, "cpu", g)
    ref = qkv.clone()
    positions = torch.randint(0, 4096, (t,), generator=g)
    q, k, v = split_qkv(qkv, hq, hkv)
    if not fused_qkv:
        q, k = q.clone(), k.clone()
    ref_q, ref_k, ref_v = split_qkv(ref, hq, hkv)
    cpu_ops.apply_rope_(q, k, positions.int() if fused_qkv else positions, cache)
    apply_rope_ref_(ref_q, ref_k, positions, cache)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, ref_v)  # next to k in memory, untouched


def test_rope_refuses_a_position_past_its_cache() -> None:
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="position 5 is past the cache's 5"):
        cpu_ops.apply_rope_(q, k, torch.tensor([5]), rope_cache(inv_freq(8), 5))


@pytest.mark.parametrize("f", [1536, 100])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_silu_mul_matches_its_reference(f: int, t: int) -> None:
    g = torch.Generator().manual_seed(t * f)
    gate_up = (3 * torch.randn(t, 2 * f + 2, generator=g))[:, : 2 * f]  # row stride 2f + 2
    _ulps(cpu_ops.silu_mul(gate_up), silu_mul_ref(gate_up), 6, (f, t))


def _paged(lens: list[int], hkv: int, d: int, g: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A random fp32 cache, and block tables [len(lens), W] giving each row its own blocks
    in no order (a column slice of a wider table: rows W + 3 apart); columns past a row's
    length hold other rows' blocks, never read."""
    need = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(2, num_blocks, BLOCK, hkv, d, generator=g)
    ids = torch.randperm(num_blocks, generator=g).int()
    width = max(need)
    tables = torch.empty(len(lens), width + 3, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b] = ids[torch.arange(at, at + width + 3) % num_blocks]
        at += n
    return cache, tables[:, :width]


def _slots(tables: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The slot of each row's newest token (position len - 1)."""
    return torch.tensor([int(tables[b, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
                         for b, n in enumerate(lens)], dtype=torch.int32)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (2, 1, 40)])
@pytest.mark.parametrize("lens", [[1], [200], [17, 1, 64, 130, 33, 16, 5, 250]])
def test_decode_attention_matches_store_and_paged_attention(hq: int, hkv: int, d: int,
                                                            lens: list[int]) -> None:
    """A step of decode rows of different lengths (one token to 16 blocks), GQA groups of
    1 to 4: the same cache after the store, bit for bit, and the same output within a few
    ulp (the scores' sums in another order, exp of its own)."""
    g = torch.Generator().manual_seed(len(lens) * d + hq)
    cache, tables = _paged(lens, hkv, d, g)
    q, k, v = split_qkv(random_qkv(len(lens), hq, hkv, d, torch.float32, "cpu", g), hq, hkv)
    slots = _slots(tables, lens)
    ref_cache = cache.clone()
    scale = d**-0.5
    got = cpu_ops.decode_attention(q, k, v, cache, slots, tables,
                                   torch.tensor(lens, dtype=torch.int32), scale)
    store_kv_ref(k, v, ref_cache, slots.long())
    want = paged_attention_ref(q, ref_cache, tables, lens, list(range(len(lens) + 1)), scale)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_decode_attention_refuses_what_would_read_outside_the_cache() -> None:
    g = torch.Generator().manual_seed(0)
    cache, tables = _paged([20], 1, 16, g)
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    slots, lens = _slots(tables, [20]), torch.tensor([20], dtype=torch.int32)
    tables[0, 1] = cache.shape[1]
    with pytest.raises(RuntimeError, match=f"block {cache.shape[1]} is outside the cache"):
        cpu_ops.decode_attention(q, k, v, cache, slots, tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="does not fit its table"):
        cpu_ops.decode_attention(q, k, v, cache, slots, tables, lens * 9, 0.25)


def _meta(lens: list[int], q_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    slots = [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK
             for b, (n, m) in enumerate(zip(lens, q_lens)) for p in range(n - m, n)]
    i32 = {"dtype": torch.int32}
    return AttentionMetadata(torch.tensor(slots, **i32), tables, torch.tensor(lens, **i32),
                             torch.tensor(starts, **i32), max(q_lens), max(lens))


@pytest.mark.parametrize("q_lens,window", [([1, 1, 1], None), ([1, 1, 1], 8), ([1, 5, 1], None)])
def test_the_fused_backend_keeps_the_reference_where_it_must(q_lens: list[int],
                                                             window: int | None) -> None:
    """A decode-only step attends in C++; a layer with a sliding window, or a step with a
    prompt's rows in it, runs the reference: the same cache and output as the reference
    backend's either way, and the same as the reference's own (window) results."""
    g = torch.Generator().manual_seed(len(q_lens) + (window or 0))
    lens = [40, 9, 23]
    hq, hkv, d = 4, 2, 32
    cache, tables = _paged(lens, hkv, d, g)
    meta = _meta(lens, q_lens, tables.contiguous())
    q, k, v = split_qkv(random_qkv(sum(q_lens), hq, hkv, d, torch.float32, "cpu", g), hq, hkv)
    outs, caches = [], []
    for fused in (True, False):
        backend, c = TorchAttention(BLOCK, fused), cache.clone()
        state = backend.build(meta)
        assert state.fused == (fused and max(q_lens) == 1)
        outs.append(backend.forward(q, k, v, c, state, d**-0.5, window))
        caches.append(c)
    assert torch.equal(caches[0], caches[1])
    if window is None and max(q_lens) == 1:
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(outs[0], outs[1])


def test_fp32_and_a_machine_that_cannot_build_keep_the_references(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """fp32 stays on the references (its tokens are Hugging Face's exactly); the other
    modes take the fused ops where the library builds, and without a compiler fall back
    with a warning naming why."""
    assert not cpu_ops.fused_for("fp32")
    assert cpu_ops.fused_for("gguf") and cpu_ops.fused_for("fp16")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="tandem.engine.cpu_ops"):
        assert not cpu_ops.fused_for("gguf")
    assert "cpu_weights gguf: the torch reference ops, not the fused ones, which needs a " \
           "C++ compiler ('/nonexistent/c++', or $CXX)" in caplog.text
