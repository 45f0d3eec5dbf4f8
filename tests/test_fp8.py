"""FP8 linear layers (engine/fp8.py): quantized at load (`quantization="fp8"`) or loaded
from an FP8 checkpoint as stored. On the CPU an FP8 layer computes with its weight
widened exactly (fp32), so a tiny transformers model whose linear weights are replaced
by those very values is the reference, token for token. The Triton kernel runs against
its torch reference under the interpreter."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from triton_interpreter import HAS_TRITON, run_under_interpreter

from tandem import LLM, SamplingParams
from tandem.engine.fp8 import Fp8Linear
from tandem.kernels.fp8_gemm import fp8_gemm_ref
from tandem.kernels.fp8_quant import FP8, quantize_rows_ref

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model() -> LlamaForCausalLM:
    torch.manual_seed(7)
    model = LlamaForCausalLM(CONFIG).eval()
    with torch.no_grad():  # decisive logits and norms that matter
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.3) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 40)]


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEAR


def _reference(model: LlamaForCausalLM, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """A copy of `model` with these linear weights (fp32)."""
    ref = LlamaForCausalLM(CONFIG).eval()
    state = model.state_dict()
    state.update(weights)
    ref.load_state_dict(state)
    return ref


def test_quantize_rows_scales_each_row_to_the_fp8_range() -> None:
    x = torch.randn(6, 40) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 1.0, 0.0])[:, None]
    q, scale = quantize_rows_ref(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert q[:5].float().abs().amax(dim=1).tolist() == [448.0] * 5
    assert scale[5] == 1.0 and not q[5].float().any()  # a zero row: scale 1, zeros
    # Each value is its row's x / scale rounded to FP8: within half an FP8 step (2^-4
    # relative, e4m3's 3 mantissa bits) of x.
    back = q.float() * scale[:, None]
    assert torch.all((back - x).abs() <= x.abs() * 2**-4 + scale[:, None] * 2**-9)


def test_an_fp8_layer_computes_with_its_widened_weight() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 24, bias=True)
    layer = Fp8Linear.of(linear)
    x = torch.randn(5, 48)
    widened = layer.weight.float() * layer.weight_scale[:, None]
    assert torch.equal(layer(x), x @ widened.t() + layer.bias)
    assert torch.equal(layer(x), fp8_gemm_ref(x, layer.weight, layer.weight_scale, layer.bias))
    assert torch.allclose(layer(x), linear(x), rtol=0.1, atol=0.1)


def test_quantization_fp8_gives_transformers_tokens_on_the_quantized_weights(
        hf_model, prompts, tmp_path: Path) -> None:  # noqa: ANN001
    """`quantization="fp8"` quantizes each linear weight per output row; transformers
    with the weights rounded the same way gives the same greedy tokens, alone and
    batched. Embeddings, norms and the logits' GEMM stay fp32."""
    hf_model.save_pretrained(tmp_path)
    rounded = {}
    for name, w in hf_model.state_dict().items():
        if _is_linear(name):
            q, scale = quantize_rows_ref(w)
            rounded[name] = q.float() * scale[:, None]
    ref = _reference(hf_model, rounded)
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(str(tmp_path), quantization="fp8")
    model = llm.engine.runner.model
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8_layers) == 4 * CONFIG.num_hidden_layers
    assert model.lm_head.weight.dtype == torch.float32
    assert [llm.generate(p, GREEDY)[0].token_ids for p in prompts] == want
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    # Not the unquantized model's tokens everywhere: the rounding is real.
    plain = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert plain != want


def _fp8_checkpoint(model: LlamaForCausalLM, path: Path, block: int | None
                    ) -> dict[str, torch.Tensor]:
    """Save `model` as an FP8 checkpoint (quant_method "fp8"): per-tensor scales, or per
    `block` x `block` tiles (`weight_scale_inv`, as DeepSeek's and Qwen3's FP8 releases);
    returns each linear weight as its FP8 values widened."""
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    widened = {}
    for name in [n for n in tensors if _is_linear(n)]:
        w = tensors[name].float()
        if block is None:
            scale = w.abs().max() / 448.0
            tensors[name] = (w / scale).to(FP8)
            tensors[name + "_scale"] = scale.reshape(())
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.5)
            widened[name] = tensors[name].float() * scale
        else:
            n, k = w.shape
            tiles = w.reshape(n // block, block, k // block, block)
            scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # [n/b, k/b]
            full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
            tensors[name] = (w / full).to(FP8)
            tensors[name + "_scale_inv"] = scale
            widened[name] = tensors[name].float() * full
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    if block is not None:
        hf["quantization_config"].update(activation_scheme="dynamic",
                                         weight_block_size=[block, block])
    (path / "config.json").write_text(json.dumps(hf))
    return widened


def test_an_fp8_checkpoint_loads_as_stored(hf_model, prompts, tmp_path: Path) -> None:  # noqa: ANN001
    """Per-tensor scales: q, k and v (and gate and up) each keep their own scale in the
    fused layers, so the weights are exactly the checkpoint's; transformers on those
    values gives the same tokens."""
    widened = _fp8_checkpoint(hf_model, tmp_path, block=None)
    want = [hf_greedy(_reference(hf_model, widened), p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(str(tmp_path))
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and attn.qkv_proj.weight.dtype == FP8
    fused = torch.cat([widened[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight.float() * attn.qkv_proj.weight_scale[:, None], fused)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_a_block_scaled_fp8_checkpoint_is_requantized_per_row(hf_model, tmp_path: Path
                                                              ) -> None:  # noqa: ANN001
    """`weight_scale_inv` per 32 x 32 tile: each row is requantized with one scale, within
    FP8's rounding of the checkpoint's values."""
    widened = _fp8_checkpoint(hf_model, tmp_path, block=32)
    llm = LLM(str(tmp_path))
    down = llm.engine.runner.model.model.layers[1].mlp.down_proj
    want = widened["model.layers.1.mlp.down_proj.weight"]
    got = down.weight.float() * down.weight_scale[:, None]
    assert torch.all((got - want).abs() <= want.abs() * 2**-4 + down.weight_scale[:, None] * 2**-9)
    assert llm.generate([5, 6, 7], GREEDY)[0].token_ids  # runs


def test_an_fp8_checkpoints_kv_scales_reach_the_attention_layers(hf_model, tmp_path: Path
                                                                   ) -> None:  # noqa: ANN001
    """`k_scale`/`v_scale` per layer (as llm-compressor writes them) load onto each layer's
    attention in fp32, where an FP8 KV cache stores k / k_scale; a 16-bit cache ignores
    them."""
    _fp8_checkpoint(hf_model, tmp_path, block=None)
    tensors = load_file(tmp_path / "model.safetensors")
    for i in range(CONFIG.num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.0123 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(2.5)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(tmp_path), kv_cache_dtype="fp8")
    attn = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    assert [a.k_scale for a in attn] == [float(torch.tensor(0.0123 * (i + 1)))
                                         for i in range(CONFIG.num_hidden_layers)]
    assert [a.v_scale for a in attn] == [2.5] * CONFIG.num_hidden_layers
    assert len(llm.generate([5, 6, 7], GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert len(LLM(str(tmp_path)).generate([5, 6, 7], GREEDY)[0].token_ids) == 16


def test_unknown_quantizations_are_refused(hf_model, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="unknown quantization 'int3'.*fp8"):
        LLM("tiny", load_format="dummy", quantization="int3")
    hf_model.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="quantization 'gptq' is not supported.*fp8"):
        LLM(str(tmp_path))


def kernel_matches_reference() -> None:
    """Under TRITON_INTERPRET=1: kernels/fp8_gemm.py against its reference, both paths
    (one row; a dot over 16-row blocks), ragged sizes, with and without a bias. The
    interpreter's bf16 dot gives garbage, so the dot path is checked in fp32 here and
    in bf16 on the GPU (tests/test_gpu_fp8.py)."""
    from tandem.kernels.fp8_gemm import fp8_gemm

    torch.manual_seed(0)
    for n, k in ((40, 96), (64, 200)):
        w8, scale = quantize_rows_ref(torch.randn(n, k))
        for dtype, rows in ((torch.float32, (1, 3, 17)), (torch.bfloat16, (1,))):
            bias = torch.randn(n).to(dtype)
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                for b in (None, bias):
                    cfgs = [None, {"BLOCK_M": 1 if m == 1 else 16, "BLOCK_N": 16, "BLOCK_K": 32,
                                   "num_warps": 4, "num_stages": 1}]
                    for cfg in cfgs:
                        got = fp8_gemm(x, w8, scale, b, config=cfg).float()
                        want = fp8_gemm_ref(x, w8, scale, b).float()
                        tol = 1e-4 if dtype == torch.float32 else 0.05
                        assert torch.allclose(got, want, rtol=tol, atol=tol), (n, k, m, dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fp8_gemm_matches_the_reference_under_the_interpreter() -> None:
    run_under_interpreter("from test_fp8 import kernel_matches_reference; "
                          "kernel_matches_reference()")


def mm_kernel_matches_reference() -> None:
    """Under TRITON_INTERPRET=1: kernels/fp8_mm.py (both sides FP8, row scales on each)
    against the reference on x widened by its scales: ragged rows, columns and K, with
    and without a bias, in the table's tiles and a small one."""
    from tandem.kernels.fp8_mm import fp8_mm, tiles

    torch.manual_seed(0)
    small = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    for m, n, k in ((3, 40, 96), (17, 64, 200), (70, 48, 320)):
        w8, scale = quantize_rows_ref(torch.randn(n, k))
        x8, x_scale = quantize_rows_ref(torch.randn(m, k) * 3)
        for bias in (None, torch.randn(n)):
            want = fp8_gemm_ref(x8.float() * x_scale[:, None], w8, scale, bias, torch.float32)
            for cfg in (small, tiles(m, n, k)):
                got = fp8_mm(x8, x_scale, w8, scale, bias, torch.float32, cfg)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-3), (m, n, k, cfg)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fp8_mm_matches_the_reference_under_the_interpreter() -> None:
    run_under_interpreter("from test_fp8 import mm_kernel_matches_reference; "
                          "mm_kernel_matches_reference()")


def quantize_kernels_match() -> None:
    """Under TRITON_INTERPRET=1: kernels/fp8_quant.py's kernels. Each row's scale bit for
    bit against the reference's, for rows held in registers, rows read twice (longer
    than `_ONE_PASS`) and a zero row; silu(gate) * up quantized in one kernel bit for bit
    against the two kernels it replaces. The FP8 values themselves are compared on the
    GPU (tests/test_gpu_fp8.py): the interpreter rounds to FP8 wrongly where a mantissa
    carries into the next power of two (124.3 / 1 -> 64) and in the subnormals."""
    from tandem.kernels import fp8_quant
    from tandem.kernels.silu_mul import silu_mul

    torch.manual_seed(0)
    for shape in ((3, 200), (2, fp8_quant._ONE_PASS + 40)):
        x = torch.randn(*shape) * 3
        x[0, :4] = torch.tensor([1e4, -1e4, 0.0, 448.0])
        x[-1] = 0.0
        q, scale = fp8_quant.quantize_rows(x)
        assert q.dtype == FP8 and q.shape == x.shape
        assert torch.equal(scale, quantize_rows_ref(x)[1]), shape
    gate_up = torch.randn(4, 2 * 300) * 4
    q, scale = fp8_quant.silu_mul_quantize(gate_up)
    want_q, want_scale = fp8_quant.quantize_rows(silu_mul(gate_up))
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_quantize_kernels_match_their_references_under_the_interpreter() -> None:
    run_under_interpreter("from test_fp8 import quantize_kernels_match; "
                          "quantize_kernels_match()")
