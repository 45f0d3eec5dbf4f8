"""x @ W^T on the CPU from a GGUF's own quantized blocks (`--cpu-weights gguf`).

The kernel (csrc/cpu_quant.cpp) reads W as the GGUF stores it, Q4_1 or Q8_0 blocks of 32
weights, widens each block in registers to exactly the fp32 weights gguf's `dequantize`
gives, and multiplies it into up to 8 rows of x at once: x, products and sums in fp32, so
the fp32 weights' result up to summation order, from 20 bytes per 32 weights (Q4_1)
instead of 128.

It is built with engine/csrc/cpu_ops.cpp into one library (engine/cpu_build.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine import cpu_build

# ggml's type ids (gguf.GGMLQuantizationType) of the formats the kernel reads, by name.
KINDS = {"Q4_1": 3, "Q8_0": 8}
# The model's fused layers and their parts, in the order it concatenates their rows
# (models/llama.py `load_weights`).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_INTO = {part: layer for layer, parts in _FUSED.items() for part in parts}


@dataclass(frozen=True)
class Blocks:
    """A weight [N, K] as a GGUF stores it: `data` uint8 [N, K / 32 * block bytes], each
    row its blocks in order along K; `kind` the format's ggml type id (KINDS)."""

    kind: int
    data: torch.Tensor


def linear(x: torch.Tensor, w: Blocks, bias: torch.Tensor | None = None
           ) -> torch.Tensor:  # x: [M, K] fp32 -> [M, N]
    cpu_build.load()
    return torch.ops.tandem_cpu_quant.linear(x, w.data, w.kind, bias)


def fused(blocks: dict[str, torch.Tensor], types: dict[str, str], name: str) -> Blocks:
    """The blocks of the model's weight `name` (a fused layer's: its parts' rows in the
    model's order) from a GGUF's `blocks` and `types` by Hugging Face name."""
    parts = _parts(name)
    return Blocks(KINDS[types[parts[0]]], torch.cat([blocks[p] for p in parts]))


def unsupported(types: dict[str, str] | None) -> str | None:
    """Why the decoder linear layers and the logits of a checkpoint whose GGUF matrices
    have `types` (None: not a GGUF) cannot run from their blocks here, or None."""
    if types is None:
        return "is for a GGUF checkpoint"
    logits = "lm_head.weight" if "lm_head.weight" in types else "model.embed_tokens.weight"
    fused_names = {_fused_name(n) for n in types if n.endswith("_proj.weight")}
    for name in sorted(fused_names | {logits}):
        kinds = {types[p] for p in _parts(name)}
        if len(kinds) > 1 or not kinds <= KINDS.keys():
            return (f"runs Q4_1 and Q8_0 blocks, one type a fused layer; this GGUF's {name} "
                    f"is {'+'.join(types[p] for p in _parts(name))}")
    return cpu_build.unavailable()


def _parts(name: str) -> list[str]:
    """`model.layers.0.mlp.gate_up_proj.weight` -> its gate_proj's and up_proj's names."""
    parent, layer, suffix = _split(name)
    return [f"{parent}{part}.{suffix}" for part in _FUSED.get(layer, (layer,))]


def _fused_name(name: str) -> str:
    """`model.layers.0.mlp.up_proj.weight` -> the name of the model's weight holding it."""
    parent, layer, suffix = _split(name)
    return f"{parent}{_FUSED_INTO.get(layer, layer)}.{suffix}"


def _split(name: str) -> tuple[str, str, str]:
    """`model.norm.weight` -> ("model.", "norm", "weight"); `lm_head.weight` -> ("", ...)."""
    module, _, suffix = name.rpartition(".")
    parent, dot, layer = module.rpartition(".")
    return parent + dot, layer, suffix
