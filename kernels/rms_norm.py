"""RMSNorm, optionally fused with the residual add before it: a Triton kernel (one
program per row) and its torch reference, both rounding as Hugging Face's Llama RMSNorm
does: normalise in fp32, round to the dtype, multiply by the weight in the dtype."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build: the torch reference does the work
    triton = None


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], x's dtype; overwritten with x + residual
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        residual.add_(x)  # x + residual, rounded to the dtype as torch's add
        return rms_norm_ref(residual, weight, eps), residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(
    x: torch.Tensor,  # [T, H], unit last stride
    weight: torch.Tensor,  # [H] contiguous, x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], unit last stride, x's dtype
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """normed(x) as a new [T, H] tensor; with a residual, s = x + residual is written over
    the residual in place and (normed(s), residual) returned."""
    assert triton is not None, "Triton is not installed"
    t, h = x.shape
    assert x.stride(1) == 1, x.stride()
    assert weight.shape == (h,) and weight.is_contiguous() and weight.dtype == x.dtype, (
        weight.shape, weight.dtype, x.dtype)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1, (
            residual.shape, residual.stride())
        assert residual.dtype == x.dtype and residual.device == x.device
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t > 0:
        block = triton.next_power_of_2(h)
        res = residual if residual is not None else x  # not read without RESIDUAL
        _rms_norm_kernel[(t,)](
            x, weight, res, out, x.stride(0), res.stride(0), h, eps,
            BLOCK=block, RESIDUAL=residual is not None,
            num_warps=max(1, min(16, block // 512)),
        )
    return out if residual is None else (out, residual)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x, weight, residual, out, x_row, res_row, h, eps,
                         BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < h
        s = tl.load(x + row * x_row + cols, mask=mask, other=0.0)
        if RESIDUAL:
            r = tl.load(residual + row * res_row + cols, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(x.dtype.element_ty)
            tl.store(residual + row * res_row + cols, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / h + eps)
        # Rounded to the dtype before the weight, as the reference.
        normed = (sf * rstd).to(x.dtype.element_ty).to(tl.float32)
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + row * h + cols, (w * normed).to(x.dtype.element_ty), mask=mask)
