"""On a CUDA machine with FP8 (Hopper, Ada): the FP8 linear paths against their torch
reference, and an FP8 engine's CUDA graphs against its eager steps. Skipped elsewhere."""

from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine import fp8
from tandem.engine.ops import logits_fp32
from tandem.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
from tandem.kernels.fp8_mm import fp8_mm
from tandem.kernels.fp8_quant import FP8, quantize_rows, quantize_rows_ref, silu_mul_quantize
from tandem.kernels.silu_mul import silu_mul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA device with FP8 (sm89+)"),
]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (960, 576), (40, 200)])
def test_fp8_gemm_matches_its_reference_in_bf16(rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows)
    w8, scale = quantize_rows_ref(torch.randn(n, k, device="cuda") / k**0.5)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = fp8_gemm_ref(x, w8, scale, bias)
    # Accumulated in fp32 either way; the output's bf16 rounding is what differs.
    assert _relative_error(fp8_gemm(x, w8, scale, bias), want) < 1e-2


@pytest.mark.parametrize("rows", [2, 17, 64, 128, 200])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (960, 576), (40, 200)])
def test_fp8_mm_matches_its_reference(rows: int, n: int, k: int) -> None:
    """Both sides FP8: the product of the widened operands, accumulated in fp32, then
    rounded to bf16 (ragged rows, columns and K included)."""
    torch.manual_seed(rows)
    w8, scale = quantize_rows_ref(torch.randn(n, k, device="cuda") / k**0.5)
    x8, x_scale = quantize_rows_ref(torch.randn(rows, k, device="cuda") * 3)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = fp8_gemm_ref(x8.float() * x_scale[:, None], w8, scale, bias, torch.bfloat16)
    assert _relative_error(fp8_mm(x8, x_scale, w8, scale, bias), want) < 1e-2


@pytest.mark.parametrize("shape", [(1, 4096), (37, 14336), (2048, 576), (3, 20000)])
def test_quantize_rows_matches_its_reference_exactly(shape: tuple[int, int]) -> None:
    torch.manual_seed(1)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :7] = torch.tensor([1e4, -1e4, 0.0, 1e-3, -2.5, 448.0, 0.5])
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize_rows_ref(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("shape", [(2, 2 * 14336), (300, 2 * 1536), (5, 2 * 20000)])
def test_silu_mul_quantize_is_silu_mul_then_quantize_rows(shape: tuple[int, int]) -> None:
    """One kernel (rows of up to 16,384 values; longer ones in two) gives the bits of
    silu_mul's then quantize_rows'."""
    torch.manual_seed(2)
    gate_up = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 4
    q, scale = silu_mul_quantize(gate_up)
    want_q, want_scale = quantize_rows(silu_mul(gate_up))
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_single_rows_take_the_logits_from_an_fp8_copy() -> None:
    """`quantization="fp8"` on CUDA keeps an FP8 copy of the logits' weight: a single
    row's fp32 logits come from it (within FP8's rounding of the bf16 weight's), more
    rows' from the weight itself, bit for bit as without the copy."""
    llm = LLM("smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16",
              quantization="fp8", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert model.logits_fp8 is not None and model.logits_fp8[0].dtype == FP8
    hidden = torch.randn(3, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    full = logits_fp32(hidden, model.logits_weight)
    assert torch.equal(model.compute_logits(hidden), full)
    one = model.compute_logits(hidden[:1])
    assert one.dtype == torch.float32 and one.shape == full[:1].shape
    assert _relative_error(one, full[:1]) < 0.05 and not torch.equal(one, full[:1])


@pytest.mark.parametrize("rows", [17, 256, 2048])
def test_scaled_mm_is_within_fp8_activation_rounding(rows: int) -> None:
    """Prefill's path quantizes x per row too: within a few percent of the weight-only
    product (e4m3 rounds each activation by up to 2^-4)."""
    torch.manual_seed(0)
    w8, scale = quantize_rows_ref(torch.randn(4096, 4096, device="cuda") / 64)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    want = fp8_gemm_ref(x, w8, scale)
    assert _relative_error(fp8.scaled_mm(x, w8, scale, None), want) < 0.05


def test_fp8_engine_graphs_give_the_eager_tokens() -> None:
    """bf16 with FP8 weights, SmolLM2's shape (dummy): decode steps replayed in CUDA
    graphs and prefill graphs give the tokens of the same engine run eagerly, alone (the
    few-row kernel) and as a batch of 32 (the many-row path): the same kernels, so the
    same tokens."""
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 40000) for _ in range(n)] for n in (3, 20, 70, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = {"load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
              "quantization": "fp8", "num_kv_blocks": 512, "max_num_seqs": 32}
    eager = LLM("smollm2-135m", enforce_eager=True, **kwargs)
    assert isinstance(eager.engine.runner.model.model.layers[0].mlp.down_proj, fp8.Fp8Linear)
    alone = [eager.generate(p, params)[0].token_ids for p in prompts]
    batch = [o.token_ids for o in eager.generate(prompts * 8, params)]
    del eager
    llm = LLM("smollm2-135m", **kwargs)
    assert llm.engine.cuda_graphs
    assert [llm.generate(p, params)[0].token_ids for p in prompts] == alone
    assert [o.token_ids for o in llm.generate(prompts * 8, params)] == batch
