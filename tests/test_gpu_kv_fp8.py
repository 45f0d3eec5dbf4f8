"""On a CUDA machine (sm89+: Triton's FP8 type), the FP8 KV cache: the Triton store, decode
and prefill kernels against the torch reference on random FP8 caches; the triton engine's
greedy tokens against the torch backend's over the same kind of cache, teacher-forced as
in tests/test_gpu.py; twice the bf16 blocks at the same memory fraction. Skipped without
CUDA; under a minute on an H100."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from test_gpu import forced_run
from test_kv_fp8 import compare_kernels
from triton_interpreter import HAS_TRITON

from tandem import LLM, SamplingParams
from tandem.engine.config import NAMED_SHAPES, CacheConfig
from tandem.engine.kv_budget import num_kv_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA"),
]
FP8 = torch.float8_e4m3fn


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def test_kernels_match_the_reference_on_cuda() -> None:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is exact too
    try:
        compare_kernels("cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_triton_engine_agrees_with_torch_over_an_fp8_cache(model: str) -> None:
    """bf16, dummy weights, kv_cache_dtype="fp8": the triton engine (CUDA graphs) decodes
    48 tokens for 8 prompts; the torch backend decodes them teacher-forced with those
    tokens, so at each of the 384 steps both pick from the same prefix over a cache of the
    same format. They round bf16 differently (fused kernels, other GEMM shapes) and a
    value near an FP8 rounding boundary may land one step apart, so near-ties on the dummy
    model's flat logits may flip: >= 90% must agree, and where they differ the triton
    token must rank within half a logit of the torch engine's own."""
    steps, kwargs = 48, {"load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
                         "kv_cache_dtype": "fp8", "num_kv_blocks": 1024, "max_num_seqs": 8,
                         "max_num_batched_tokens": 512}
    rng = random.Random(5)
    vocab = NAMED_SHAPES[model].vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 16, 17, 60, 130,
                                                                     255, 400)]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    fast = LLM(model, **kwargs)
    assert fast.engine.attention_backend == "triton" and fast.engine.cuda_graphs
    assert fast.engine.runner.kv_caches[0].dtype == FP8
    outs = [o.token_ids for o in fast.generate(prompts, params)]
    del fast
    _free()
    ref = LLM(model, attention_backend="torch", async_scheduling=False, **kwargs).engine
    _, picked, short = forced_run(ref, prompts, outs, params)
    expected = [t for out in outs for t in out]
    differ = [i for i, (a, b) in enumerate(zip(picked, expected)) if a != b]
    total = len(expected)
    print(f"{model} fp8 KV, triton vs torch: {total - len(differ)}/{total} greedy tokens "
          f"agree; shortfalls where they differ: {sorted(round(-short[i], 4) for i in differ)}")
    del ref
    _free()
    assert total == 8 * steps and len(differ) <= total // 10, f"{len(differ)}/{total} differ"
    assert all(-short[i] < 0.5 for i in differ)


def test_fp8_doubles_the_bf16_blocks_at_the_same_memory_fraction() -> None:
    """The same budget (sized back to back, nothing allocated between): a bf16 block is
    two FP8 blocks, the null block included, floor division the only slack. An engine
    sized after another is freed gets the same count to within 1%."""
    _free()
    cfg, device = NAMED_SHAPES["smollm2-135m"], torch.device("cuda")
    cache = CacheConfig(kv_cache_memory_fraction=0.3)
    bf16 = num_kv_blocks(cfg, cache, torch.bfloat16, device)
    fp8 = num_kv_blocks(cfg, cache, FP8, device)
    assert fp8 + 1 in (2 * (bf16 + 1), 2 * (bf16 + 1) + 1), (bf16, fp8)
    kwargs = {"load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
              "kv_cache_memory_fraction": 0.3, "enforce_eager": True}
    counts = []
    for kv in ("auto", "fp8"):
        engine = LLM("smollm2-135m", kv_cache_dtype=kv, **kwargs).engine
        counts.append(engine.block_pool.num_blocks)
        del engine
        _free()
    assert abs((counts[1] + 1) - 2 * (counts[0] + 1)) <= (counts[0] + 1) // 50, counts
