"""`cpu_weights="bf16"`, `"fp16"` and `"gguf"`: an fp32 model's decoder linear layers packed
as bf16 for oneDNN, or (with the logits) as fp16 for fbgemm, or run from a GGUF's own
blocks (engine/cpu_quant.py, whose kernel tests/test_cpu_quant.py checks), on the CPU
(engine/cpu_linear.py). Each layer computes what its rounded weights (and, for bf16,
inputs) with fp32 accumulation give; SmolLM2's greedy tokens against fp32's are reported
per prompt (the 20 prompts of the GPU test), and the chat answer still says Paris."""

from __future__ import annotations

import pytest
import torch
from prompts import CHAT, LONG_CHAT, LONG_RAW, RAW

from tandem import LLM, SamplingParams
from tandem.engine import cpu_build, cpu_linear
from tandem.engine.config import EngineConfig
from tandem.engine.loader import ModelSource, gguf_matrix_types
from tandem.engine.ops import CPU_FUSED_OPS, CPU_OPS


def _cpu_weights(config: EngineConfig, device: torch.device,
                 gguf_types: dict[str, str] | None = None) -> str:
    return cpu_linear.weights_mode(config.cpu_weights, device, config.dtype, gguf_types)


needs_bf16 = pytest.mark.skipif(not cpu_linear.has_bf16_packing(),
                                reason="needs oneDNN's bf16 weights (AVX-512 or AVX-NE-CONVERT)")
needs_fp16 = pytest.mark.skipif(not cpu_linear.has_fp16_gemm(),
                                reason="needs fbgemm's fp16 GEMM (x86 with AVX2)")
needs_gguf_kernel = pytest.mark.skipif(cpu_build.missing() is not None,
                                       reason=f"engine/cpu_build.py {cpu_build.missing()}")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 17, 300])
def test_a_packed_layer_computes_in_bf16_with_fp32_accumulation(rows: int) -> None:
    torch.manual_seed(rows)
    linear = torch.nn.Linear(576, 1536, bias=True)
    holder = torch.nn.Module()
    holder.gate_up_proj = linear
    assert cpu_linear.pack_bf16(holder, torch.zeros(8, 576)) == 1
    x = torch.randn(rows, 576)
    got = cpu_linear.linear(x, linear.weight, linear.bias)
    exact = x.bfloat16().double() @ linear.weight.bfloat16().double().t()
    # The result is rounded to bf16 (8 bits): within one bf16 step of the exact product.
    step = exact.abs() * 2**-8 + 1e-6
    assert torch.all((got - linear.bias - exact.float()).abs() <= step.float())


@needs_bf16
def test_bf16_weights_pack_every_decoder_linear_layer_and_keep_the_logits_fp32() -> None:
    model, packed = _tiny_packed("bf16", cpu_linear._PACKED_BF16)
    assert len(packed) == 4 * model.config.num_layers
    assert not hasattr(model.model.embed_tokens.weight, cpu_linear._PACKED_BF16)
    assert getattr(model.logits_weight, cpu_linear._ALWAYS_PACKED)  # fp32, packed


def _tiny_packed(mode: str, attribute: str) -> tuple[torch.nn.Module, list[str]]:
    """A tiny model loaded with cpu_weights=`mode`, which generates 8 tokens, and the
    names of its parameters that carry `attribute` (a packing)."""
    llm = LLM("tiny", load_format="dummy", num_kv_blocks=32, cpu_weights=mode)
    assert llm.engine.cpu_weights == mode
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([1, 2, 3], params)[0].token_ids) == 8
    model = llm.engine.runner.model
    return model, [n for n, p in model.named_parameters() if hasattr(p, attribute)]


@needs_fp16
@pytest.mark.parametrize("rows", [1, 5, 64, 65])
def test_an_fp16_layer_multiplies_fp32_inputs_by_fp16_rounded_weights(rows: int) -> None:
    """Up to 64 rows fbgemm's fp16 GEMM (the bias packed with the weight); more rows the
    fp32 weight as it is."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(576, 1536, bias=True)
    holder = torch.nn.Module()
    holder.down_proj = linear
    assert cpu_linear.pack_fp16(holder, torch.zeros(8, 576)) == 2  # the logits too
    x = torch.randn(rows, 576)
    got = cpu_linear.linear(x, linear.weight, linear.bias).double()
    w = linear.weight.half() if rows <= 64 else linear.weight
    exact = x.double() @ w.double().t() + linear.bias.double()
    # fp32 accumulation of 576 products: within a few fp32 steps of the sum's magnitude.
    bound = (x.double().abs() @ w.double().abs().t() + linear.bias.double().abs()) * 2**-20
    assert torch.all((got - exact).abs() <= bound)
    if rows <= 64:  # and not the fp32 weight's product: the rounding shows
        assert not torch.allclose(got, x.double() @ linear.weight.double().t()
                                  + linear.bias.double(), rtol=0, atol=1e-6)


@needs_fp16
def test_fp16_weights_pack_every_decoder_linear_layer_and_the_logits() -> None:
    model, packed = _tiny_packed("fp16", cpu_linear._PACKED_FP16)
    assert len(packed) == 4 * model.config.num_layers + 1
    assert hasattr(model.logits_weight, cpu_linear._PACKED_FP16)


def test_auto_picks_fp16_or_bf16_only_for_an_fp32_model_on_the_cpu() -> None:
    auto = EngineConfig("tiny", cpu_weights="auto")
    native = ("fp16" if cpu_linear.has_fp16_gemm()
              else "bf16" if cpu_linear.has_native_bf16() else "fp32")
    assert _cpu_weights(auto, torch.device("cpu")) == native
    assert _cpu_weights(auto, torch.device("cuda")) == "fp32"
    assert _cpu_weights(EngineConfig("tiny", dtype=torch.bfloat16, cpu_weights="auto"),
                        torch.device("cpu")) == "fp32"
    for mode in ("bf16", "fp16"):
        with pytest.raises(ValueError, match=f"cpu_weights='{mode}' is for an fp32 model on"):
            _cpu_weights(EngineConfig("tiny", dtype=torch.bfloat16, cpu_weights=mode),
                         torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown cpu_weights 'int3'"):
        EngineConfig("tiny", cpu_weights="int3")


@needs_gguf_kernel
def test_auto_picks_gguf_for_a_gguf_checkpoint_in_fp32_on_the_cpu(
        smollm2_source: ModelSource) -> None:
    """SmolLM2's GGUF (Q4_1 layers, a Q8_0 embedding) runs from its blocks under auto; a
    checkpoint that is no GGUF is refused gguf by name, and auto passes it over."""
    types = gguf_matrix_types(smollm2_source)
    auto = EngineConfig("tiny", cpu_weights="auto")
    assert _cpu_weights(auto, torch.device("cpu"), types) == "gguf"
    assert _cpu_weights(auto, torch.device("cuda"), types) == "fp32"
    assert _cpu_weights(EngineConfig("tiny", cpu_weights="gguf"), torch.device("cpu"),
                        types) == "gguf"
    assert _cpu_weights(auto, torch.device("cpu")) != "gguf"
    with pytest.raises(ValueError, match="cpu_weights='gguf' is for a GGUF checkpoint; "
                                         "choose fp16 or fp32"):
        _cpu_weights(EngineConfig("tiny", cpu_weights="gguf"), torch.device("cpu"))
    with pytest.raises(ValueError, match="cpu_weights='gguf' is for an fp32 model on"):
        _cpu_weights(EngineConfig("tiny", dtype=torch.bfloat16, cpu_weights="gguf"),
                     torch.device("cpu"), types)


@pytest.mark.parametrize("mode,runs_here", [("bf16", cpu_linear.has_bf16_packing),
                                             ("fp16", cpu_linear.has_fp16_gemm)])
def test_a_mode_this_cpu_cannot_run_is_refused_by_name(mode: str, runs_here) -> None:  # noqa: ANN001
    """Asked for a packing this CPU lacks (bf16 on an AVX2-only x86), the engine refuses
    it with what it needs and the other choices, before loading anything; one it has is
    taken."""
    config = EngineConfig("tiny", cpu_weights=mode)
    if runs_here():
        assert _cpu_weights(config, torch.device("cpu")) == mode
    else:
        with pytest.raises(ValueError, match=f"cpu_weights='{mode}' needs .*; choose"):
            _cpu_weights(config, torch.device("cpu"))


@pytest.mark.parametrize("mode", [
    pytest.param("bf16", marks=needs_bf16),
    pytest.param("fp16", marks=needs_fp16),
    pytest.param("gguf", marks=needs_gguf_kernel),
])
def test_smollm2_agrees_with_fp32_and_still_says_paris(offline, mode: str) -> None:  # noqa: ANN001
    """The 20 prompts of the GPU test, 32 greedy tokens each: how many lead tokens `mode`
    shares with fp32, per prompt (printed); most prompts agree for a good while (fp16 and
    gguf, whose activations stay fp32: 20 of 20 for all 32 on the 2-core machine; gguf's
    decode steps of 20 rows run its kernel), and the capital of France is still Paris.
    `mode` runs the fused C++ ops (engine/cpu_ops.py) where fp32 keeps the references."""
    half = LLM("smollm2-135m-instruct", num_kv_blocks=1024, cpu_weights=mode)
    assert half.engine.runner.model.ops is CPU_FUSED_OPS and half.engine.runner.attention.fused
    assert offline.engine.runner.model.ops is CPU_OPS and not offline.engine.runner.attention.fused
    tok = half.get_tokenizer()
    prompts = ([tok.apply_chat_template([{"role": "user", "content": c}])
                for c in CHAT + [LONG_CHAT]] + [tok.encode(r) for r in RAW + [LONG_RAW]])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in offline.generate(prompts, params)]
    got = [o.token_ids for o in half.generate(prompts, params)]
    lead = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
            for g, w in zip(got, want)]
    print(f"{mode} against fp32, equal lead tokens of 32 per prompt: {lead}")
    share = {"bf16": 1 / 2, "fp16": 3 / 4, "gguf": 3 / 4}[mode]
    assert sum(n == 32 for n in lead) >= len(prompts) * share, lead
    answer = half.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in answer[0].text
