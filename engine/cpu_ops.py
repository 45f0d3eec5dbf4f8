"""The small ops of a CPU decode step fused in C++ (csrc/cpu_ops.cpp): RMSNorm with the
residual add, RoPE in place, SiLU·mul, and decode attention straight from the paged fp32
cache. Each does what its torch reference in kernels/ does in one call instead of a few
to a dozen, in fp32, to a few ulp of it (RoPE bit for bit); tests/test_cpu_ops.py holds
them to that.

Where they run: an engine whose CPU weights are not fp32 (`fused_for`), gguf's, fp16's
and bf16's, whose tokens are measured against fp32's (tests/test_cpu_weights.py); fp32
keeps the references, whose greedy tokens equal Hugging Face's exactly, and so does any
machine where the library does not build.

What they save, SmolLM2-135M's GGUF (`--cpu-weights gguf`) on the 2-core machine: per
decode step of one row (cProfile), the references' attention 3.8 ms, RoPE 2.2, RMSNorm
2.2, KV store 0.7 and SiLU·mul 0.6 against these ops' 0.5 (attention with the store),
0.05, 0.2 and 0.07; a decode step, the two in turn, 17.3 -> 7.8-9.0 ms at one row and
33.4 -> 20.9-23.0 at eight, of which the GEMMs are 5.3 and 15.5.
"""

from __future__ import annotations

import logging

import torch

from tandem.engine import cpu_build

log = logging.getLogger(__name__)


def fused_for(cpu_weights: str) -> bool:
    """Whether an engine with `cpu_weights` (engine/cpu_linear.py `weights_mode`; any
    but fp32 is an fp32 model on the CPU) runs these ops: not for fp32, else where the
    library builds (built here the first time)."""
    if cpu_weights == "fp32":
        return False
    if why := cpu_build.unavailable():
        log.warning("cpu_weights %s: the torch reference ops, not the fused ones, which %s",
                    cpu_weights, why)
        return False
    return True


def rms_norm(
    x: torch.Tensor,  # [T, H] fp32, unit last stride
    weight: torch.Tensor,  # [H] fp32 contiguous
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]; overwritten with x + residual
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's: normed(x), or with a residual (normed(x + residual), residual)."""
    if residual is None:
        return torch.ops.tandem_cpu_ops.rms_norm(x, weight, eps, None)
    return torch.ops.tandem_cpu_ops.rms_norm(x, weight, eps, residual), residual


def apply_rope_(
    q: torch.Tensor,  # [T, Hq, D] fp32, unit last stride (a view of a fused qkv)
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int32 or int64
    cache: torch.Tensor,  # [max_positions, D] fp32, kernels/rope.py's rope_cache
) -> None:
    torch.ops.tandem_cpu_ops.rope_(q, k, positions, cache)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2F] fp32 -> [T, F]
    return torch.ops.tandem_cpu_ops.silu_mul(gate_up)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D] fp32, unit last stride: one query a row
    k: torch.Tensor,  # [B, Hkv, D]: the rows' new K and V, stored at `slots` first
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] fp32 contiguous
    slots: torch.Tensor,  # [B] int32 or int64
    block_tables: torch.Tensor,  # [>= B, W] int32: row b's blocks
    seq_lens: torch.Tensor,  # [B] int32: row b's tokens, the new one included
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """store_kv_ref then paged_attention_ref for a step of decode rows: each q head over
    its row's tokens read through the block table, no gathered copies; softmax in fp32."""
    return torch.ops.tandem_cpu_ops.decode_attention(
        q, k, v, kv_cache, slots, block_tables, seq_lens, scale)
