"""FP8 linear layers (float8_e4m3fn weights, one fp32 scale per output row).

Two ways in, one layer:
- `quantize(model)` (`--quantization fp8`): a model loaded in bf16 has each decoder
  layer's linear layers quantized, per output row, scale = the row's largest |w| / 448.
- a checkpoint whose `quantization_config.quant_method` is "fp8" keeps its FP8 weights
  as they are: `convert(model)` swaps the layers before loading, and `checkpoint_tensors`
  turns the checkpoint's scales (per tensor, per row, or per 128x128 block) into one
  per row.

Which layers: attention's qkv and output projections and the dense MLP's (the GEMMs of
a step's weight bytes). The embeddings, the norms, the MoE router and the stacked
experts stay in the model's dtype (the fused MoE kernel reads bf16). The logits' GEMM
too, except for a single row on CUDA under `--quantization fp8` (`quantize_logits`):
a decode step of one sequence reads the logits' weight whole (1 GB of Llama-3-8B's 16 in
bf16), so that row streams an FP8 copy of it, kept beside the weight.

How a layer runs (`Fp8Linear.forward`), on CUDA:
- one row (a decode step of one sequence): weight-only, kernels/fp8_gemm.py, which
  streams the FP8 bytes (x stays bf16);
- more rows: x is quantized per row (dynamic per-token scales, kernels/fp8_quant.py) and
  multiplied on the FP8 tensor cores with row-wise scales on both sides: by
  kernels/fp8_mm.py up to a decode batch's rows where its tiles beat cuBLAS, else by
  `torch._scaled_mm`. Measured against each other in kernels/fp8_gemm.py's and
  kernels/fp8_mm.py's comments. The MLP's down projection takes silu(gate) * up
  quantized by the kernel that computes it (`Fp8Linear.of_silu_mul`).
Elsewhere (the CPU) the weight is widened per call: correct, slow, for tests.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from tandem.kernels import fp8_mm, fp8_quant
from tandem.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref, triton
from tandem.kernels.fp8_quant import FP8, quantize_rows_ref

# Decoder layers' linear layers that become FP8 (the fused names, as the model holds them;
# engine/cpu_linear.py packs the same ones as bf16).
LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The checkpoint tensors (Hugging Face names) stored in FP8 that load as FP8.
CHECKPOINT_LINEAR = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# Up to this many rows the weight-only kernel; more, `_scaled_mm` (benchmarks/fp8_gemm.py).
MAX_GEMV_ROWS = 1


class Fp8Linear(nn.Module):
    """y = x @ (weight * scale[:, None])^T + bias, weight [N, K] FP8, scale [N] fp32."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8, device=device),
            requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.ones(out_features, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear` quantized per output row."""
        w = linear.weight.detach()
        layer = cls(w.shape[1], w.shape[0], linear.bias is not None, w.dtype, w.device)
        layer.weight.data, layer.weight_scale.data = quantize_rows_ref(w)
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if not x.is_cuda or triton is None:
            return fp8_gemm_ref(x, self.weight, self.weight_scale, self.bias)
        if x.shape[0] <= MAX_GEMV_ROWS:
            return fp8_gemm(x, self.weight, self.weight_scale, self.bias)
        return scaled_mm(x, self.weight, self.weight_scale, self.bias)

    def of_silu_mul(self, gate_up: torch.Tensor, silu_mul: Callable) -> torch.Tensor:
        """This layer of silu(gate) * up ([T, 2F] -> [T, N]): on CUDA, more than
        MAX_GEMV_ROWS rows are quantized by the kernel that computes them; else
        `silu_mul` (the model's) then `forward`."""
        if gate_up.is_cuda and triton is not None and gate_up.shape[0] > MAX_GEMV_ROWS:
            xq, x_scale = fp8_quant.silu_mul_quantize(gate_up)
            return _scaled(xq, x_scale, self.weight, self.weight_scale, self.bias,
                           gate_up.dtype)
        return self(silu_mul(gate_up))


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x quantized per row, then cuBLAS's FP8 GEMM with row-wise scales on both sides."""
    return _scaled(*fp8_quant.quantize_rows(x), weight, scale, bias, x.dtype)


def _scaled(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    tile = fp8_mm.tiles(xq.shape[0], weight.shape[0], weight.shape[1])
    if tile is not None:  # a decode step's few rows: kernels/fp8_mm.py where it is faster
        return fp8_mm.fp8_mm(xq, x_scale, weight, scale, bias, dtype, tile)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None], scale_b=scale[None, :],
                           out_dtype=dtype)
    return out if bias is None else out + bias


@torch.no_grad()
def quantize_logits(model: nn.Module) -> None:
    """Keep an FP8 copy of the logits' weight (per row, beside it) for single rows."""
    model.logits_fp8 = quantize_rows_ref(model.logits_weight.detach())


def logits(hidden: torch.Tensor, weight_fp8: tuple[torch.Tensor, torch.Tensor]
           ) -> torch.Tensor | None:
    """A single row's fp32 logits from the FP8 copy; None for more rows (or off CUDA):
    those take the weight itself."""
    if not hidden.is_cuda or triton is None or hidden.shape[0] > MAX_GEMV_ROWS:
        return None
    return fp8_gemm(hidden, *weight_fp8, out_dtype=torch.float32)


def _swap(model: nn.Module, make: type[Fp8Linear] | None) -> None:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in LAYERS and isinstance(child, nn.Linear):
                w = child.weight
                new = (Fp8Linear.of(child) if make is None else
                       make(w.shape[1], w.shape[0], child.bias is not None, w.dtype, w.device))
                setattr(module, name, new)


@torch.no_grad()
def quantize(model: nn.Module) -> None:
    """Replace the decoder layers' linear layers by FP8 ones quantized from their weights,
    one at a time (the bf16 weight is freed as its FP8 copy is made)."""
    _swap(model, None)


def convert(model: nn.Module) -> None:
    """Replace them by empty FP8 layers, for a checkpoint's FP8 weights to load into."""
    _swap(model, Fp8Linear)


def checkpoint_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                       block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's tensors as the model loads them: each FP8 linear weight stays
    FP8 with `<name>_scale` [N] fp32 beside it (a per-tensor scale is repeated per row;
    a per-block one, `weight_scale_inv`, is folded into the weight, requantized per row);
    any other FP8 tensor is widened to `dtype`; activation scales are dropped (activation
    scales are computed per token, at run time); the KV cache's `k_scale`/`v_scale` are
    kept, in fp32 (the model sets them on its attention layers)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        if name.endswith(("k_scale", "v_scale")):  # the KV cache's: kept in fp32
            out[name] = t.float()
            continue
        if t.dtype != FP8:
            out[name] = t.to(dtype)
            continue
        scale = tensors.get(name + "_scale")
        inv = tensors.get(name + "_scale_inv")
        w8, rows = _rows(t, scale, inv, block)
        if CHECKPOINT_LINEAR.search(name):
            out[name], out[name + "_scale"] = w8, rows
        else:
            out[name] = (w8.float() * rows[:, None]).to(dtype)
    return out


def _rows(w: torch.Tensor, scale: torch.Tensor | None, inv: torch.Tensor | None,
          block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 [N, K], scales [N]) for a checkpoint's weight and its scale."""
    n = w.shape[0]
    if inv is not None:
        if block is None:
            raise ValueError("an FP8 checkpoint with weight_scale_inv needs weight_block_size")
        bn, bk = block
        full = inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :w.shape[1]]
        return quantize_rows_ref(w.float() * full)
    if scale is None:
        raise ValueError("an FP8 weight without its weight_scale")
    if scale.numel() == 1:
        return w, scale.float().reshape(1).expand(n).contiguous()
    return w, scale.float().reshape(n)
