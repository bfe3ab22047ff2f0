"""Memory-lean autograd for the model's elementwise layers: the same values and gradients as the plain
PyTorch expressions, with fewer tensors kept for backward.

  rms_norm(x, weight, eps)  weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32. Autograd of the
                            plain expression keeps x and the normalised x (two (..., C) tensors per
                            norm); this keeps x and the fp32 rstd (..., 1).
  swiglu(gate, up)          silu(gate) * up. Autograd keeps gate, silu(gate) and up; this keeps gate
                            and up and recomputes silu(gate) in backward (elementwise, cheap beside
                            the matrix products around it).
  rms_norm_linear(x, ...)   rms_norm(x) fed to one or more linear layers (q, k and v; gate and up).
                            Each linear would keep the normalised x for its weight's gradient; this
                            keeps x and rstd only and normalises again in backward.
  swiglu_linear(g, u, ...)  a linear layer over swiglu(g, u) (the MLP's down projection), which would
                            keep silu(g) * u; this keeps g and u only (backward needs silu(g) anyway).
  residual_add(x, branch)   x + branch; a bf16 branch (autocast) is added to the fp32 stream in one
                            pass on CPU, without torch's float32 copy of it first (keeps nothing).

Per token and layer of a Llama block (C d_model, F d_ff): the first two save 2C + F floats, the
last two another 2C + F. SmolLM2-135M, bytes per token and layer, plain -> rms_norm and swiglu ->
the fused ones: fp32 44,588 -> 33,836 -> 23,084; bf16 autocast 30,380 -> 22,700 -> 13,868 (there
autocast also keeps a bf16 copy of the normalised x per projection and of silu(g) * u, which the fused
ones never make; tests/test_model.py counts both). Under autocast they keep their projections' bf16
weights for backward, as autocast's own products keep theirs (per layer 7,077,888 bytes on
SmolLM2-135M). Casting them again in backward instead kept up to 184 MiB less over 30 layers but took
0.03 s of a 6-7 s step; the measured peak rose by 25-90 MiB (BENCHMARKS.md, "Real model").

All run the plain expressions' own ops in the same order, forward and backward (autograd's chain
rule written out, its matrix products in its operand order), so values and gradients are
bit-identical to the plain versions (tests/test_layers.py). The fused ones do so under autocast
too, as autocast runs the plain expression: the norm in fp32, the normalised x (or silu(g) * u)
cast once to autocast's dtype, each weight and bias cast, the products in that dtype, and in
backward each cast's gradient cast back (per projection, before the sum over them). They take
autocast's state from their forward. Without gradients they run the plain expressions, and so
under autocast with a torch-function mode (precision.Bf16GemmInFp32), which moves the products to
fp32 kernels that their backward would not follow.

On CPU the elementwise parts (the norm and its backward with the sum over projections, silu(g) * u
and its backward) run as one C loop each (`ropelab.layer_kernels`), rounding where those ops round
but with their own exp and sums: within one rounding of the plain expressions, and the fused and
unfused layers share them, so those two stay bit-identical. Elsewhere, or with
``ROPELAB_CPU_KERNEL=0``, the torch ops above run.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import has_torch_function

from ropelab.layer_kernels import (add_widened_loop, rms_norm_backward_loop, rms_norm_loop, swiglu_backward_loop,
                                   swiglu_loop)
from ropelab.precision import autocast_dtype


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32


def _normalised(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: Optional[torch.dtype] = None,
                rstd: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * (x * rstd).to(x.dtype), cast to `dtype` if given; rstd), from the given rstd or a new one:
    the CPU loop (`layer_kernels`) where it applies, else the torch ops."""
    out_dtype = dtype or torch.promote_types(weight.dtype, x.dtype)
    fast = rms_norm_loop(x, weight, eps, out_dtype, rstd)
    if fast is not None:
        return fast
    rstd = _rstd(x, eps) if rstd is None else rstd
    return _cast(weight * (x.float() * rstd).to(x.dtype), dtype), rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, rstd = _normalised(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        return *_rms_norm_backward([grad], x, weight, rstd, *ctx.needs_input_grad[:2]), None


def _rms_norm_backward(parts: list[torch.Tensor], x, weight, rstd, need_x: bool, need_weight: bool):
    """Gradients of x and weight of weight * (x * rstd).to(x.dtype), given the output's gradient as the
    sum of `parts` (the gradients of the projections it feeds, added last first, as autograd adds them)."""
    fast = rms_norm_backward_loop(parts, x, weight, rstd, need_x, need_weight)
    if fast is not None:
        return fast
    dtype = torch.promote_types(weight.dtype, x.dtype)
    grad = parts[-1].to(dtype)
    for part in reversed(parts[:-1]):
        grad = grad + part.to(dtype)
    xf = x.float()
    grad_weight = None
    if need_weight:  # the normalised x, recomputed
        grad_weight = (grad * (xf * rstd).to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
    grad_x = None
    if need_x:
        # autograd's own chain rule through x * rsqrt(mean(x^2) + eps), op for op: the gradient of
        # the normalised x (rounded to x's dtype, as autograd rounds it through forward's .to),
        # then the direct term plus the one through rstd, mean and pow
        g = (grad * weight).to(x.dtype).float()
        grad_rstd = -0.5 * (g * xf).sum(-1, keepdim=True) * rstd.pow(3)
        grad_x = (g * rstd + grad_rstd / x.shape[-1] * (2 * xf)).to(x.dtype)
    return grad_x, grad_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, -1) + eps), normalised in fp32 and rounded back to x's dtype before the
    weight (Llama's RMSNorm); saves x and the rstd for backward."""
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _swiglu(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        _, grad_gate, grad_up = _swiglu_backward(gate, up, grad, *ctx.needs_input_grad[:2], with_hidden=False)
        return grad_gate, grad_up


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    fast = swiglu_loop(gate, up)
    return F.silu(gate) * up if fast is None else fast


def swiglu_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up written over gate, without autograd (an inference forward: no new (..., F) tensor):
    the CPU loop where it applies, else torch's in-place ops; the values of `swiglu`."""
    fast = swiglu_loop(gate, up, out=gate)
    return F.silu(gate, inplace=True).mul_(up) if fast is None else fast


def _swiglu_backward(gate, up, grad, need_gate: bool, need_up: bool, with_hidden: bool):
    """(silu(gate) * up if `with_hidden`, else None; the gradients of gate and up) for the gradient `grad` of
    silu(gate) * up: the CPU loop where it applies, else torch's ops."""
    if need_gate or need_up:
        fast = swiglu_backward_loop(gate, up, grad, with_hidden)
        if fast is not None:
            hidden, grad_gate, grad_up = fast
            return hidden, grad_gate if need_gate else None, grad_up if need_up else None
    silu = F.silu(gate)
    hidden = silu * up if with_hidden else None
    grad_gate = torch.ops.aten.silu_backward((grad * up).to(gate.dtype), gate) if need_gate else None
    grad_up = (grad * silu).to(up.dtype) if need_up else None
    return hidden, grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (the SwiGLU MLP's hidden activation); saves gate and up for backward."""
    return _SwiGLU.apply(gate, up)


class _ResidualAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        ctx.branch_dtype = branch.dtype
        out = add_widened_loop(x, branch)
        return x + branch if out is None else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.to(ctx.branch_dtype)  # add's backward, and the cast autograd gives a bf16 input


def residual_add(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """x + branch: a block's branch added to the residual stream. Under bf16 autocast on CPU the branch is
    bf16 and the stream float32, and torch copies the branch to float32 before it adds; here one C loop
    (`layer_kernels.add_widened_loop`) does both, with the same values and gradients."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and branch.dtype == torch.bfloat16:
        return _ResidualAdd.apply(x, branch)
    return x + branch


def fusable(x: torch.Tensor) -> bool:
    """Whether the fused layers run their own autograd node: while recording gradients, unless
    autocast is on together with a torch-function mode or tensor subclass (precision.Bf16GemmInFp32
    moves autocast's matrix products to fp32 kernels, which this module's backward would not follow)."""
    if not torch.is_grad_enabled():
        return False
    return not (torch.is_autocast_enabled(x.device.type) and has_torch_function((x,)))


def _cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """t as autocast hands it to a matrix product of `dtype`: a floating tensor cast, except fp64."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # (..., N) -> (tokens, N), as matmul folds a linear's input


def _linear_backward(grad, x, weight, need_x: bool, need_weight: bool, need_bias: bool):
    """Gradients of F.linear(x, weight, bias) as autograd computes them: x's is grad @ weight, the
    weight's grad^T x over the folded tokens (autograd's order for a transposed weight), the bias's
    the sum over tokens."""
    rows = _rows(grad)
    grad_x = grad.matmul(weight) if need_x else None
    grad_weight = rows.t().mm(_rows(x)) if need_weight else None
    grad_bias = rows.sum(0) if need_bias else None
    return grad_x, grad_weight, grad_bias


def _to(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """The backward of autocast's cast: a gradient back in its tensor's own dtype."""
    return None if t is None else t.to(dtype)


class _RMSNormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, norm_weight, eps, *params):  # params: weight, bias (or None) of each linear
        ctx.autocast = autocast_dtype(x.device.type)  # backward casts as this forward did, whatever is on then
        ctx.eps = eps
        ctx.bias_dtypes = [None if b is None else b.dtype for b in params[1::2]]
        ctx.weight_dtypes = [w.dtype for w in params[0::2]]
        with torch.autocast(x.device.type, enabled=False):
            normed, rstd = _normalised(x, norm_weight, eps, ctx.autocast)  # cast once for all the linears
            weights = [_cast(w, ctx.autocast) for w in params[0::2]]  # kept for backward, as autocast keeps them
            outs = tuple(F.linear(normed, w, _cast(b, ctx.autocast)) for w, b in zip(weights, params[1::2]))
        ctx.save_for_backward(x, norm_weight, rstd, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, norm_weight, rstd, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with torch.autocast(x.device.type, enabled=False):
            cast, _ = _normalised(x, norm_weight, ctx.eps, ctx.autocast, rstd)
            grad_params, parts = [], []
            for i in range(len(weights)):
                bias_dtype = ctx.bias_dtypes[i]
                part, grad_weight, grad_bias = _linear_backward(
                    grads[i], cast, weights[i], True, needs[3 + 2 * i],
                    bias_dtype is not None and needs[4 + 2 * i])
                parts.append(part)  # summed last first, in the norm's dtype (each linear's cast, backward)
                grad_params += [_to(grad_weight, ctx.weight_dtypes[i]), _to(grad_bias, bias_dtype)]
            grad_x, grad_norm_weight = _rms_norm_backward(parts, x, norm_weight, rstd, needs[0], needs[1])
        return grad_x, grad_norm_weight, None, *grad_params


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    linears: list[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> tuple[torch.Tensor, ...]:
    """F.linear(rms_norm(x, norm_weight, eps), weight, bias) for each (weight, bias) of `linears`,
    keeping only x and rstd for backward (module docstring)."""
    if not fusable(x):
        normed = rms_norm(x, norm_weight, eps)
        return tuple(F.linear(normed, w, b) for w, b in linears)
    return _RMSNormLinear.apply(x, norm_weight, eps, *(t for pair in linears for t in pair))


class _SwiGLULinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        ctx.autocast = autocast_dtype(gate.device.type)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.weight_dtype = weight.dtype
        with torch.autocast(gate.device.type, enabled=False):
            hidden = _cast(_swiglu(gate, up), ctx.autocast)
            cast_weight = _cast(weight, ctx.autocast)  # kept for backward, as autocast keeps it
            out = F.linear(hidden, cast_weight, _cast(bias, ctx.autocast))
        ctx.save_for_backward(gate, up, cast_weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with torch.autocast(gate.device.type, enabled=False):
            grad_hidden, _, _ = _linear_backward(grad, None, weight, needs[0] or needs[1], False, False)
            if grad_hidden is not None:  # autocast's cast of silu(gate) * up, backward
                grad_hidden = grad_hidden.to(torch.promote_types(gate.dtype, up.dtype))
            hidden, grad_gate, grad_up = _swiglu_backward(gate, up, grad_hidden, needs[0], needs[1],
                                                          with_hidden=needs[2])
            _, grad_weight, grad_bias = _linear_backward(grad, _cast(hidden, ctx.autocast), None, False, needs[2],
                                                         needs[3])
        return grad_gate, grad_up, _to(grad_weight, ctx.weight_dtype), _to(grad_bias, ctx.bias_dtype)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(swiglu(gate, up), weight, bias), keeping only gate and up for backward (module docstring)."""
    if not fusable(gate):
        return F.linear(swiglu(gate, up), weight, bias)
    return _SwiGLULinear.apply(gate, up, weight, bias)
