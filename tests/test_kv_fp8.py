"""The FP8 KV cache (`kv_cache_dtype="fp8"`): float8_e4m3fn blocks holding K / k_scale and
V / v_scale, saturated at +-448. The torch reference stores and reads exactly that; the
Triton kernels agree with it (under the interpreter here, on CUDA in
tests/test_gpu_kv_fp8.py); an engine fits twice a bf16 cache's blocks in the same
bytes, hashes its blocks apart from a 16-bit cache's, and moves them through the host
tier and a KV transfer bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
from kv_helpers import roundtrip
from test_gpu import forced_run
from test_kernel_decode_attention import make_inputs
from test_kernel_prefill_attention import MIXED, make_batch
from triton_interpreter import HAS_TRITON, run_under_interpreter

from tandem import LLM, SamplingParams
from tandem.engine.block_hash import hash_prompt, root_hash
from tandem.engine.config import NAMED_SHAPES, CacheConfig
from tandem.engine.kv_budget import kv_block_bytes
from tandem.kernels.kv_store import quantize_ref, read_kv_ref, store_kv_ref
from tandem.kernels.paged_attention import paged_attention_ref
from tandem.kvtransfer.connector import get_connector
from tandem.kvtransfer.layout import KVLayout

FP8 = torch.float8_e4m3fn
PAGE = 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
TINY = {"load_format": "dummy", "dtype": "float32"}


def quantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache gives back for x, written out."""
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def quantize_cache(kv: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """[2, ...] float -> the FP8 cache holding it (NaN, a poisoned slot, stays NaN)."""
    return torch.stack([quantize_ref(kv[0], k_scale), quantize_ref(kv[1], v_scale)])


def dequantized(kv8: torch.Tensor, k_scale: float, v_scale: float,
                dtype: torch.dtype) -> torch.Tensor:
    """The `dtype` cache holding the values an FP8 cache reads as."""
    return torch.stack([read_kv_ref(kv8[0], k_scale, dtype), read_kv_ref(kv8[1], v_scale, dtype)])


# --- configuration and sizing ---------------------------------------------------------


def test_kv_cache_dtype_names() -> None:
    for name in ("fp8", "fp8_e4m3"):
        assert CacheConfig(kv_cache_dtype=name).kv_dtype(torch.bfloat16) == FP8
    assert CacheConfig().kv_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype 'int8'.*'auto', 'fp8'"):
        CacheConfig(kv_cache_dtype="int8")


def test_an_fp8_block_is_half_a_bf16_block() -> None:
    cfg = NAMED_SHAPES["llama-3-8b"]
    fp8 = kv_block_bytes(cfg, 16, FP8)
    assert kv_block_bytes(cfg, 16, torch.bfloat16) == 2 * fp8
    assert kv_block_bytes(cfg, 16, torch.float32) == 4 * fp8 == 4 * 32 * 2 * 16 * 8 * 128


# --- the torch reference --------------------------------------------------------------


def test_store_then_read_gives_the_saturated_quantized_values() -> None:
    g = torch.Generator().manual_seed(0)
    tokens, heads, dim, k_scale, v_scale = 40, 2, 16, 0.3, 1.7
    k = torch.randn(tokens, heads, dim, generator=g) * 30
    v = torch.randn(tokens, heads, dim, generator=g) * 30
    # Past +-448 x scale: an unsaturated cast would give NaN (e4m3fn has no infinity).
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 448 * k_scale * 1.05, -1e30])
    v[3, 1, :2] = torch.tensor([-1e6, 1e6])
    cache = torch.zeros(2, 8, PAGE, heads, dim, dtype=FP8)
    slots = torch.randperm(8 * PAGE, generator=g)[:tokens]
    store_kv_ref(k, v, cache, slots, k_scale, v_scale)
    flat = cache.view(2, -1, heads, dim)
    got_k = read_kv_ref(flat[0][slots], k_scale, torch.float32)
    got_v = read_kv_ref(flat[1][slots], v_scale, torch.float32)
    assert torch.equal(got_k, quantized(k, k_scale)) and torch.equal(got_v, quantized(v, v_scale))
    assert not got_k.isnan().any() and not got_v.isnan().any()
    assert got_k[0, 0, :4].tolist() == pytest.approx([448 * k_scale, -448 * k_scale,
                                                      448 * k_scale, -448 * k_scale])
    assert got_v[3, 1, :2].tolist() == pytest.approx([-448 * v_scale, 448 * v_scale])
    # Within range the error is e4m3's: 3 mantissa bits, at most 1/16 of the value.
    small = k.abs() < 400 * k_scale
    assert ((got_k - k).abs() <= k.abs() / 16 + 2**-9 * k_scale)[small].all()
    unwritten = torch.ones(8 * PAGE, dtype=torch.bool)
    unwritten[slots] = False
    assert not flat[:, unwritten].view(torch.uint8).any()


def test_a_16_bit_cache_ignores_the_scales() -> None:
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 5, 2, 16, generator=g)
    cache = torch.zeros(2, 2, PAGE, 2, 16, dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, 0, 30, 9])
    store_kv_ref(k, v, cache, slots, k_scale=0.3, v_scale=5.0)
    flat = cache.view(2, -1, 2, 16)
    assert torch.equal(flat[0][slots], k.bfloat16()) and torch.equal(flat[1][slots], v.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_reads_what_the_fp8_cache_holds(dtype: torch.dtype) -> None:
    """paged_attention_ref over an FP8 cache == over a `dtype` cache holding its
    dequantized values, on decode rows, whole prompts, chunks after a prefix and empty
    rows, with and without a window and soft-capping. The step's own k/v (the shortcut a
    whole prompt takes with a 16-bit cache) are passed as noise: an FP8 cache's rows
    must attend to what it holds, never to them."""
    g = torch.Generator().manual_seed(2)
    q, kv, tables, seq_lens, starts = make_batch(MIXED, 8, 2, 64, torch.float32, "cpu", g,
                                                 poison=False)
    kv8 = quantize_cache(kv, 0.25, 0.5)
    same = dequantized(kv8, 0.25, 0.5, dtype)
    noise = torch.randn(q.shape[0], 2, 64, generator=g).to(dtype)
    q = q.to(dtype)
    lens, starts = seq_lens.tolist(), starts.tolist()
    for window, softcap in ((None, None), (9, None), (None, 0.3)):
        got = paged_attention_ref(q, kv8, tables.long(), lens, starts, 0.125, None, noise,
                                  noise, window, softcap, k_scale=0.25, v_scale=0.5)
        want = paged_attention_ref(q, same, tables.long(), lens, starts, 0.125,
                                   window=window, softcap=softcap)
        assert not want.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# --- the Triton kernels ---------------------------------------------------------------


def compare_kernels(device: str) -> None:
    """store_kv, decode_attention and prefill_attention over FP8 caches against their
    references. Under the interpreter the store is checked on values the scales map
    onto FP8 exactly (powers-of-two scales), plus saturated ones: the interpreter's
    float -> FP8 cast rounds some values just below a power of two to half of it (31.6
    -> 16), where CUDA's gives 32. On CUDA: random values, any scale, bit for bit. The
    interpreter computes bf16 tl.dot on the raw bits (triton-lang/triton#11584): bf16
    attention is checked on CUDA only."""
    from tandem.kernels.decode_attention import decode_attention, decode_attention_ref
    from tandem.kernels.kv_store import store_kv
    from tandem.kernels.prefill_attention import prefill_attention, prefill_attention_ref

    cuda = device == "cuda"
    g = torch.Generator().manual_seed(3)
    scales = (0.3, 1.7) if cuda else (0.5, 4.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        heads, dim, tokens = 3, 64, 50
        if cuda:
            k, v = torch.randn(2, tokens, heads, dim, generator=g) * 40
        else:  # FP8 values times the scale: exact in every dtype here
            k, v = quantize_ref(torch.randn(2, tokens, heads, dim, generator=g) * 40, 1.0).float()
            k, v = k * scales[0], v * scales[1]
        k[0, 0, :3] = torch.tensor([1e5, -1e5, 448.5 * scales[0]])
        v[1, 2, :2] = torch.tensor([-3e4, 3e4])
        k, v = k.to(dtype).to(device), v.to(dtype).to(device)
        slots = torch.randperm(6 * PAGE, generator=g)[:tokens].to(device)
        got = torch.zeros(2, 6, PAGE, heads, dim, dtype=FP8, device=device)
        want = torch.zeros_like(got)
        store_kv(k, v, got, slots.to(torch.int32), *scales)
        store_kv_ref(k, v, want, slots, *scales)
        codes, want_codes = got.view(torch.uint8).int(), want.view(torch.uint8).int()
        if cuda and dtype != torch.float32:
            # Measured on an H100: ~0.4% of the bf16 values stored land one FP8 step from
            # torch's (the codes of one sign are in order: one step is one code apart).
            assert (codes - want_codes).abs().max() <= 1, dtype
            assert (codes != want_codes).sum() < 0.02 * k.numel() * 2, dtype
        else:
            assert torch.equal(codes, want_codes), dtype

    dtypes = [torch.float32, torch.float16] + [torch.bfloat16] * cuda
    k_scale, v_scale = (0.3, 0.7) if cuda else (0.25, 0.5)
    # (group, head dim, kv heads, lens, splits, window, softcap)
    decode_cases = [(4, 64, 2, [1, 15, 16, 17, 33, 100], 1, 0, 0.0),
                    (3, 128, 1, [17, 40, 5], 3, 0, 0.0), (8, 64, 1, [17], 8, 0, 0.0),
                    (4, 64, 2, [1, 15, 16, 17, 33, 100], 3, 13, 0.5)]
    if cuda:
        decode_cases += [(4, 128, 8, [1, 100, 1000, 2049], 5, 0, 0.0)]
    for i, (dtype, case) in enumerate((d, c) for d in dtypes for c in decode_cases):
        group, dim, hkv, lens, splits, window, softcap = case
        q, kv, tables, seq_lens = make_inputs(lens, group, dim, hkv, torch.float32, device, i)
        q, kv8 = q.to(dtype), quantize_cache(kv, k_scale, v_scale)
        want = decode_attention_ref(q, kv8, tables, seq_lens, dim**-0.5, window, softcap,
                                    k_scale, v_scale)
        got = decode_attention(q, kv8, tables, seq_lens, dim**-0.5, splits, window=window,
                               softcap=softcap, k_scale=k_scale, v_scale=v_scale,
                               fp16_dots=False)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                   msg=lambda m, c=(dtype, case): f"decode {c}: {m}")
        if dtype == torch.float32:  # and the engine's reference reads the same
            engine = paged_attention_ref(
                q, kv8, tables.long(), lens, list(range(len(lens) + 1)), dim**-0.5,
                window=window or None, softcap=softcap or None, k_scale=k_scale,
                v_scale=v_scale)
            torch.testing.assert_close(engine, want, atol=tol, rtol=tol)

    for i, case in enumerate(decode_cases):  # a bf16 q's products in fp16 (the default)
        group, dim, hkv, lens, splits, window, softcap = case
        q, kv, tables, seq_lens = make_inputs(lens, group, dim, hkv, torch.float32, device, i)
        q, kv8 = q.to(torch.bfloat16), quantize_cache(kv, k_scale, v_scale)
        want = decode_attention_ref(q, kv8, tables, seq_lens, dim**-0.5, window, softcap,
                                    k_scale, v_scale)
        got = decode_attention(q, kv8, tables, seq_lens, dim**-0.5, splits, window=window,
                               softcap=softcap, k_scale=k_scale, v_scale=v_scale,
                               fp16_dots=True)
        tol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol,
                                   msg=lambda m, c=case: f"decode, fp16 dots {c}: {m}")

    prefill_cases = [(MIXED, 8, 2, 64, 0, 0.0), (MIXED, 3, 1, 128, 0, 0.0),
                     (MIXED, 6, 2, 64, 13, 0.7)]
    if cuda:
        long = [(700, 600), (300, 300), (1000, 1), (129, 65), (64, 0)]
        prefill_cases += [(long, 32, 8, 128, 0, 0.0), (long, 12, 4, 128, 100, 30.0)]
    for dtype in dtypes:
        for lens, hq, hkv, dim, window, softcap in prefill_cases:
            q, kv, tables, seq_lens, starts = make_batch(lens, hq, hkv, dim, torch.float32,
                                                         device, g)
            q, kv8 = q.to(dtype), quantize_cache(kv, k_scale, v_scale)
            max_q = max(n for _, n in lens)
            want = prefill_attention_ref(q, kv8, tables, seq_lens, starts, dim**-0.5, window,
                                         softcap, k_scale, v_scale)
            got = prefill_attention(q, kv8, tables, seq_lens, starts, max_q, dim**-0.5,
                                    window=window, softcap=softcap, k_scale=k_scale,
                                    v_scale=v_scale)
            assert not want.isnan().any()
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol,
                                       msg=lambda m, c=(dtype, hq, hkv, dim, window):
                                       f"prefill {c}: {m}")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_match_the_reference_under_the_interpreter() -> None:
    run_under_interpreter("from test_kv_fp8 import compare_kernels; compare_kernels('cpu')",
                          timeout=600)


# --- the engine -----------------------------------------------------------------------


def test_the_same_bytes_hold_four_times_the_fp32_blocks() -> None:
    """Both caches take the whole budget: blocks + 1 (the null block) of each, 4x."""
    auto = LLM("tiny", kv_cache_bytes=1 << 22, **TINY).engine
    fp8 = LLM("tiny", kv_cache_bytes=1 << 22, kv_cache_dtype="fp8", **TINY).engine
    assert (auto.block_pool.num_blocks, fp8.block_pool.num_blocks) == (511, 2047)
    assert [c.dtype for c in fp8.runner.kv_caches] == [FP8, FP8]
    nbytes = [sum(c.numel() * c.element_size() for c in e.runner.kv_caches) for e in (auto, fp8)]
    assert nbytes == [1 << 22, 1 << 22]


def test_layer_0_holds_exactly_the_quantized_keys_and_values() -> None:
    """Layer 0's K/V do not depend on attention, so the FP8 engine's layer-0 cache is
    exactly quantize_ref of the fp32 engine's, at the scales set on its Attention module
    (as a loader would) and carried to the store."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 17, 40, 100)]
    once = SamplingParams(temperature=0.0, max_tokens=1)  # the prompts' KV only
    auto = LLM("tiny", num_kv_blocks=32, **TINY)
    auto.generate(prompts, once)
    ref = auto.engine.runner.kv_caches[0]
    # The largest key past 448 x k_scale: it saturates.
    k_scale, v_scale = ref[0].abs().max().item() / 600, ref[1].abs().max().item() / 100
    fp8 = LLM("tiny", num_kv_blocks=32, kv_cache_dtype="fp8", **TINY)
    attn = fp8.engine.runner.model.model.layers[0].self_attn
    attn.k_scale, attn.v_scale = k_scale, v_scale
    fp8.generate(prompts, once)
    got = fp8.engine.runner.kv_caches[0]
    want = quantize_cache(ref, k_scale, v_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert (want[0].float().abs() == 448).any() and want[1].float().abs().max() < 448


def test_greedy_tokens_follow_the_fp32_engine() -> None:
    """The fp32 engine decodes 32 tokens for 10 prompts; the FP8 engine decodes the same
    prompts teacher-forced with those tokens, so both pick each of the 320 greedy tokens
    from the same prefix. FP8 K/V carry e4m3's error (up to 1/16 of a value) and the
    dummy model's logits are flat (std ~1 over 512 tokens, top log-prob ~-3.5), so
    near-ties flip: 289/320 agree here, and at every step that differs the fp32 token
    is within 0.14 logits of the FP8 engine's pick. A cache read at the wrong slot, the
    wrong scale or unquantized would move logits by whole units."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)]
               for n in (1, 3, 15, 16, 17, 40, 64, 100, 129, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = [o.token_ids for o in LLM("tiny", **TINY).generate(prompts, params)]
    fp8 = LLM("tiny", kv_cache_dtype="fp8", async_scheduling=False, **TINY).engine
    _, picked, short = forced_run(fp8, prompts, outs, params)
    expected = [t for out in outs for t in out]
    differ = [i for i, (a, b) in enumerate(zip(picked, expected)) if a != b]
    assert len(expected) == 320 and len(differ) <= 40, f"{len(differ)}/320 differ"
    assert max(-short[i] for i in differ) < 0.5


def test_fp8_blocks_hash_apart_from_16_bit_ones() -> None:
    """The prefix-cache root names the cache's dtype only when it is FP8 (a 16-bit
    cache's hashes are those of before), and the router, which hashes with the dtype of
    the node's KVLayout, computes the same root."""
    prompt = list(range(3, 40))
    auto = LLM("tiny", num_kv_blocks=8, **TINY).engine
    fp8 = LLM("tiny", num_kv_blocks=8, kv_cache_dtype="fp8", **TINY).engine
    assert auto.scheduler.kv.root == root_hash("tiny", "float32", 16)
    assert fp8.scheduler.kv.root == root_hash("tiny", "float8_e4m3fn", 16)
    theirs, ours = (hash_prompt(prompt, 16, e.scheduler.kv.root) for e in (auto, fp8))
    assert len(ours) == 2 and not set(ours) & set(theirs)
    for engine in (auto, fp8):
        layout = KVLayout.of(engine.runner.kv_caches, engine.model_name)
        assert root_hash(layout.model_id, layout.dtype, layout.block_size) == \
            engine.scheduler.kv.root


def test_fp8_blocks_come_back_from_the_host_tier() -> None:
    """tests/test_host_tier.py's first case with an FP8 cache: every evicted block comes
    back from host memory bit for bit, so the tokens are those of an engine that caches
    nothing."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(50)] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kwargs = {**TINY, "kv_cache_dtype": "fp8"}
    want = [o.token_ids for o in LLM("tiny", num_kv_blocks=64, enable_prefix_caching=False,
                                     **kwargs).generate(prompts, greedy)]
    llm = LLM("tiny", num_kv_blocks=10, host_kv_bytes=1 << 20, max_num_seqs=2, **kwargs)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    assert llm.engine.num_prompt_tokens_cached_host == 6 * 48
    assert llm.engine.host_tier.blocks_loaded == 6 * 3


def test_fp8_caches_travel_over_a_kv_transfer_unchanged() -> None:
    roundtrip(get_connector("tcp"), FP8, [7, 2, 11, 5], [0, 3, 1, 9])
    layout = KVLayout.of([torch.zeros(2, 4, PAGE, 2, 64, dtype=FP8)], "m")
    assert layout.dtype == "float8_e4m3fn" and layout.block_bytes == 2 * PAGE * 2 * 64
