"""The small decode-path kernels (kernels/kv_store.py, rms_norm.py, rope.py, silu_mul.py,
qk_norm_rope.py) against their torch references, and the references against Hugging Face's Llama."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import HAS_TRITON, run_under_interpreter

from tandem.kernels.kv_store import store_kv, store_kv_ref
from tandem.kernels.qk_norm_rope import qk_norm_rope_, qk_norm_rope_ref_
from tandem.kernels.rms_norm import rms_norm, rms_norm_ref
from tandem.kernels.rope import apply_rope_, apply_rope_ref_, rope_cache
from tandem.kernels.silu_mul import silu_mul, silu_mul_ref

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-5


def inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


def steps(device: str, dtype: torch.dtype) -> int:
    """Rounding steps of the dtype a kernel may be off by where both sides compute in fp32
    and round once: one, and one more under Triton's interpreter (3.9) in bf16, whose
    fp32 -> bf16 cast truncates instead of rounding to nearest as the GPU does."""
    return 1 + (device == "cpu" and dtype == torch.bfloat16)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: tuple, ulps: int) -> None:
    """fp32: a few ulps (sums in another order; on the GPU Triton's exp, rsqrt and
    division are approximate and products may fuse into fma); half types: `ulps`
    rounding steps of the dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    eps = torch.finfo(want.dtype).eps
    rtol = 2e-6 if want.dtype == torch.float32 else ulps * eps
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6, msg=lambda m: f"{what}: {m}")


def split_qkv(qkv: torch.Tensor, hq: int, hkv: int) -> tuple[torch.Tensor, ...]:
    """q [T, hq, D], k and v [T, hkv, D]: strided views of a fused [T, (hq + 2 hkv) D]."""
    t, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    return q, k, v


def random_qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str,
               g: torch.Generator) -> torch.Tensor:
    return torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(device)


def compare_rms_norm(device: str, dtype: torch.dtype, g: torch.Generator) -> None:
    # One step more: normed(s) is rounded before the weight multiply and after it.
    n = steps(device, dtype) + 1
    for h in (576, 100):
        for t in (1, 7):
            what = ("rms_norm", dtype, h, t)
            x = torch.randn(t, h + 3, generator=g).to(dtype).to(device)[:, :h]  # row stride h+3
            w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(device)
            x_before = x.clone()
            assert_close(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), what, n)
            res = torch.randn(t, h, generator=g).to(dtype).to(device)
            res_ref = res.clone()
            out, res_out = rms_norm(x, w, EPS, res)
            want, _ = rms_norm_ref(x, w, EPS, res_ref)
            assert res_out is res, what
            if steps(device, dtype) == 1:
                assert torch.equal(res, res_ref), what  # x + residual, rounded as torch's add
            assert_close(res, res_ref, what, steps(device, dtype))
            assert_close(out, want, (*what, "residual"), n)
            assert torch.equal(x, x_before), what


def compare_silu_mul(device: str, dtype: torch.dtype, g: torch.Generator) -> None:
    for f in (1536, 100):
        for t in (1, 7):
            what = ("silu_mul", dtype, f, t)
            gate_up = (3 * torch.randn(t, 2 * f, generator=g)).to(dtype).to(device)
            want = silu_mul_ref(gate_up)
            assert_close(silu_mul(gate_up), want, what, steps(device, dtype))
            out = torch.zeros(t, f + 5, dtype=dtype, device=device)[:, :f]
            assert silu_mul(gate_up, out) is out
            assert_close(out, want, (*what, "out"), steps(device, dtype))


def compare_rope(device: str, dtype: torch.dtype, g: torch.Generator) -> None:
    for d, hq, hkv in ((64, 9, 3), (128, 4, 1)):
        cache = rope_cache(inv_freq(d), 4096).to(device)
        for t in (1, 7):
            what = ("rope", dtype, d, t)
            qkv = random_qkv(t, hq, hkv, d, dtype, device, g)
            positions = torch.randint(0, 4096, (t,), generator=g).to(device)
            ref = qkv.clone()
            q, k, v = split_qkv(qkv, hq, hkv)
            ref_q, ref_k, ref_v = split_qkv(ref, hq, hkv)
            apply_rope_ref_(ref_q, ref_k, positions, cache)
            apply_rope_(q, k, positions, cache)
            assert_close(q, ref_q, what, steps(device, dtype))
            assert_close(k, ref_k, what, steps(device, dtype))
            assert torch.equal(v, ref_v), what  # next to k in memory, untouched


def compare_qk_norm_rope(device: str, dtype: torch.dtype, g: torch.Generator) -> None:
    # The normed value and its product with the weight are rounded before the rotation (and
    # Triton's rsqrt is approximate): a step of those moves an output by a step of its
    # inputs' size, not of its own, which the rotation's difference may make small.
    n = 8 if dtype == torch.float32 else steps(device, dtype) + 1  # fp32: sums' order
    for d, hq, hkv in ((64, 9, 3), (128, 32, 4)):
        cache = rope_cache(inv_freq(d), 4096).to(device)
        qw, kw = ((1 + 0.3 * torch.randn(d, generator=g)).to(dtype).to(device) for _ in "qk")
        for t in (1, 7):
            what = ("qk_norm_rope", dtype, d, t)
            qkv = 4 * random_qkv(t, hq, hkv, d, dtype, device, g)
            positions = torch.randint(0, 4096, (t,), generator=g).to(device)
            ref = qkv.clone()
            q, k, v = split_qkv(qkv, hq, hkv)
            ref_q, ref_k, ref_v = split_qkv(ref, hq, hkv)
            qk_norm_rope_ref_(ref_q, ref_k, qw, kw, 1e-6, positions, cache)
            qk_norm_rope_(q, k, qw, kw, 1e-6, positions, cache)
            for got, want in ((q, ref_q), (k, ref_k)):
                atol = n * torch.finfo(dtype).eps * want.abs().amax(-1, keepdim=True)
                assert ((got.float() - want.float()).abs() <= atol).all(), (
                    what, (got.float() - want.float()).abs().max())
            assert torch.equal(v, ref_v), what  # next to k in memory, untouched


def compare_kv_store(device: str, dtype: torch.dtype, g: torch.Generator) -> None:
    """Rows 0 and 3 are padding aimed at the null slot 0; every other slot, exactly. The
    fp32 -> bf16 cast is checked on the GPU only (see `steps`)."""
    num_blocks, block_size = 6, 4
    cases = [(3, 64, dtype), (2, 128, dtype)]
    if steps(device, dtype) == 1:
        cases.append((2, 128, torch.float32))
    for hkv, d, in_dtype in cases:
        cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype).to(device)
        for slots in ([0, 9, 10, 0, 23, 4, 11], [13]):
            what = ("kv_store", dtype, in_dtype, hkv, d, len(slots))
            _, k, v = split_qkv(random_qkv(len(slots), 4, hkv, d, in_dtype, device, g), 4, hkv)
            slot_mapping = torch.tensor(slots, device=device)
            got, want = cache.clone(), cache.clone()
            store_kv(k, v, got, slot_mapping)
            store_kv_ref(k, v, want, slot_mapping)
            keep = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
            keep[0] = False
            flat = (2, num_blocks * block_size, hkv, d)
            assert torch.equal(got.view(flat)[:, keep], want.view(flat)[:, keep]), what
            written = [i for i, s in enumerate(slots) if s != 0]
            assert torch.equal(got.view(flat)[0, [slots[i] for i in written]],
                               k[written].to(dtype)), what


def compare(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        compare_rms_norm(device, dtype, g)
        compare_silu_mul(device, dtype, g)
        compare_rope(device, dtype, g)
        compare_qk_norm_rope(device, dtype, g)
        compare_kv_store(device, dtype, g)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_match_references_under_the_interpreter() -> None:
    run_under_interpreter("from test_kernels_small import compare; compare('cpu')")


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA")
def test_kernels_match_references_on_cuda() -> None:
    compare("cuda")


def test_references_match_hugging_face_llama() -> None:
    """In fp32 the references are Hugging Face's Llama ops, exactly; in bf16 rms_norm_ref
    still is (HF rounds the same way), while rope and silu_mul round once where HF rounds
    after each op."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 576, generator=g).to(dtype)
        norm = llama.LlamaRMSNorm(576, eps=EPS).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(576, generator=g))
            assert torch.equal(rms_norm_ref(x, norm.weight, EPS), norm(x)), dtype
    q, k = torch.randn(7, 9, 64, generator=g), torch.randn(7, 3, 64, generator=g)
    positions = torch.randint(0, 4096, (7,), generator=g)
    freqs = positions.float()[:, None] * inv_freq(64)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D], as HF's rotary
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    qkv = torch.cat([q.flatten(1), k.flatten(1), torch.zeros(7, 3 * 64)], dim=1)
    fused_q, fused_k = qkv[:, :576].view(7, 9, 64), qkv[:, 576:768].view(7, 3, 64)
    apply_rope_ref_(q, k, positions, rope_cache(inv_freq(64), 4096))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    apply_rope_ref_(fused_q, fused_k, positions, rope_cache(inv_freq(64), 4096))  # one pass
    assert torch.equal(fused_q, want_q) and torch.equal(fused_k, want_k)
    assert not qkv[:, 768:].any()  # v, next to k, untouched
    gate_up = torch.randn(7, 2 * 100, generator=g)
    assert torch.equal(silu_mul_ref(gate_up), F.silu(gate_up[:, :100]) * gate_up[:, 100:])


def test_rope_cache_layout() -> None:
    cache = rope_cache(inv_freq(8), 5)
    freqs = torch.arange(5, dtype=torch.float32)[:, None] * inv_freq(8)[None, :]
    assert cache.dtype == torch.float32 and cache.shape == (5, 8)
    assert torch.equal(cache, torch.cat((freqs.cos(), freqs.sin()), dim=-1))
