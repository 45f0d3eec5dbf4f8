"""engine/cpu_quant.py's kernel: x @ W^T from GGUF Q4_1 and Q8_0 blocks, against the fp32
weights gguf's own `dequantize` gives; and SmolLM2's blocks as `--cpu-weights gguf` packs
them, which are its fp32 weights, row for row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tandem import LLM
from tandem.engine import cpu_build, cpu_linear, cpu_quant

pytestmark = pytest.mark.skipif(cpu_build.missing() is not None,
                                reason=f"engine/cpu_build.py {cpu_build.missing()}")


def _blocks(n: int, k: int, kind: str, seed: int) -> tuple[cpu_quant.Blocks, torch.Tensor]:
    """Random weights [n, k] as `kind` blocks, and the fp32 weights they stand for."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    qtype = GGMLQuantizationType[kind]
    blocks = quantize(w, qtype)
    fp32 = torch.from_numpy(np.array(dequantize(blocks, qtype), dtype=np.float32))
    return cpu_quant.Blocks(cpu_quant.KINDS[kind], torch.from_numpy(blocks)), fp32


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("n,k", [(37, 96), (1536, 576)])  # 37: not a whole tile of 4
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_multiplies_by_the_dequantized_weights(kind: str, rows: int, n: int, k: int,
                                                          with_bias: bool) -> None:
    """fp32 products and sums of exactly the dequantized weights: within a few fp32 steps
    of the exact sum's magnitude (2^-20; measured up to 2^-24)."""
    blocks, w = _blocks(n, k, kind, seed=rows)
    x = torch.randn(rows, k)
    bias = torch.randn(n) if with_bias else None
    got = cpu_quant.linear(x, blocks, bias).double()
    b = torch.zeros(n) if bias is None else bias
    exact = x.double() @ w.double().t() + b.double()
    bound = (x.double().abs() @ w.double().abs().t() + b.double().abs()) * 2**-20
    assert got.shape == (rows, n)
    assert torch.all((got - exact).abs() <= bound)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_block_widens_to_exactly_the_dequantized_weights(kind: str) -> None:
    """Rows of the identity pick the weights' columns: each equals gguf's fp32 weight bit
    for bit (d * code, then + m, each rounded: no FMA), the low nibbles weights 0-15."""
    blocks, w = _blocks(37, 64, kind, seed=0)
    assert torch.equal(cpu_quant.linear(torch.eye(64), blocks), w.t())


def test_blocks_of_another_shape_are_refused() -> None:
    blocks, _ = _blocks(8, 64, "Q4_1", seed=0)
    with pytest.raises(RuntimeError, match="do not hold rows of 96 weights"):
        cpu_quant.linear(torch.randn(1, 96), blocks)


def test_a_gguf_with_other_formats_is_refused_by_name() -> None:
    """A fused layer runs from its parts' blocks only where they share a format the
    kernel reads; the logits' weight (the embedding, when tied) too."""
    types = {f"model.layers.0.self_attn.{p}_proj.weight": "Q4_1" for p in "qkvo"}
    types |= {f"model.layers.0.mlp.{p}_proj.weight": "Q4_1" for p in ("gate", "up", "down")}
    types["model.embed_tokens.weight"] = "Q8_0"
    assert cpu_quant.unsupported(types) is None
    assert "is for a GGUF" in cpu_quant.unsupported(None)
    mixed = types | {"model.layers.0.self_attn.v_proj.weight": "Q8_0"}
    assert cpu_quant.unsupported(mixed) == (
        "runs Q4_1 and Q8_0 blocks, one type a fused layer; this GGUF's "
        "model.layers.0.self_attn.qkv_proj.weight is Q4_1+Q4_1+Q8_0")
    k_quant = types | {"model.embed_tokens.weight": "Q6_K"}
    assert "model.embed_tokens.weight is Q6_K" in cpu_quant.unsupported(k_quant)


def test_smollm2_blocks_are_its_fp32_weights_in_the_model_row_order() -> None:
    """Every decoder linear layer's blocks (q/k rows unpermuted, q/k/v and gate/up
    concatenated as the model fuses them) and the logits' (the tied embedding, Q8_0)
    dequantize to the model's fp32 weight exactly."""
    llm = LLM("smollm2-135m-instruct", num_kv_blocks=64, cpu_weights="gguf")
    assert llm.engine.cpu_weights == "gguf"
    model = llm.engine.runner.model
    packed = {n: getattr(p, cpu_linear._GGUF_BLOCKS) for n, p in model.named_parameters()
              if hasattr(p, cpu_linear._GGUF_BLOCKS)}
    assert len(packed) == 4 * model.config.num_layers + 1
    assert packed["model.embed_tokens.weight"].kind == cpu_quant.KINDS["Q8_0"]
    weights = dict(model.named_parameters())
    for name, blocks in packed.items():
        qtype = GGMLQuantizationType(blocks.kind)
        widened = torch.from_numpy(dequantize(blocks.data.numpy(), qtype))
        assert torch.equal(widened, weights[name].detach()), name
