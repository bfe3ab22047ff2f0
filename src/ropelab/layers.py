"""Memory-lean autograd for the model's elementwise layers: the same values and gradients as the plain
PyTorch expressions, with fewer tensors kept for backward.

  rms_norm(x, weight, eps)  weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32. Autograd of the
                            plain expression keeps x and the normalised x (two (..., C) tensors per
                            norm); this keeps x and the fp32 rstd (..., 1).
  swiglu(gate, up)          silu(gate) * up. Autograd keeps gate, silu(gate) and up; this keeps gate
                            and up and recomputes silu(gate) in backward (elementwise, cheap beside
                            the matrix products around it).

Per token and layer of a Llama block (C d_model, F d_ff) that is 2C + F fewer floats saved for
backward (SmolLM2-135M: 2,688 of ~11,700); BENCHMARKS.md ("Real model") has the measured peaks.
Both run the plain expressions' own ops in the same order, forward and backward (autograd's chain
rule written out), so values and gradients are bit-identical to the plain versions in fp32, bf16 and
mixed (tests/test_layers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:  # the normalised x, recomputed
            grad_weight = (grad * (xf * rstd).to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # autograd's own chain rule through x * rsqrt(mean(x^2) + eps), op for op: the gradient of
            # the normalised x (rounded to x's dtype, as autograd rounds it through forward's .to),
            # then the direct term plus the one through rstd, mean and pow
            g = (grad * weight).to(x.dtype).float()
            grad_rstd = -0.5 * (g * xf).sum(-1, keepdim=True) * rstd.pow(3)
            grad_x = (g * rstd + grad_rstd / x.shape[-1] * (2 * xf)).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, -1) + eps), normalised in fp32 and rounded back to x's dtype before the
    weight (Llama's RMSNorm); saves x and the rstd for backward."""
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward((grad * up).to(gate.dtype), gate)
        if ctx.needs_input_grad[1]:
            grad_up = (grad * F.silu(gate)).to(up.dtype)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (the SwiGLU MLP's hidden activation); saves gate and up for backward."""
    return _SwiGLU.apply(gate, up)
