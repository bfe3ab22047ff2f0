"""Mixed precision: bf16 autocast, and how its matrix products run on CPUs without bf16 instructions.

A bf16 GEMM multiplies bf16 operands and accumulates in fp32. The product of two bf16 numbers (8-bit
significands) is exact in fp32, so an fp32 GEMM on bf16-rounded operands, rounded back to bf16, is the
same arithmetic up to the order of the sums. On CPUs without AVX512-BF16 or AMX, PyTorch's own bf16
kernels are many times slower than its fp32 ones (an AVX2 Zen 3 here: 24 against 170 GFLOP/s on 2
threads), so there `Bf16GemmInFp32` runs the autocast's linear layers and attention that way.
Everything else (which ops run in bf16, the bf16 activations between them, fp32 losses) stays
autocast's. `train.bf16_gemm` chooses: `native`, `fp32`, or `auto` (fp32 on such CPUs only)."""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

BF16_GEMM = ("auto", "native", "fp32")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), as oneDNN reports it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def gemm_in_fp32(policy: str, device: torch.device | str) -> bool:
    """Whether bf16 autocast on `device` runs its matrix products as fp32 GEMMs (CPU only)."""
    if policy not in BF16_GEMM:
        raise ValueError(f"bf16_gemm={policy!r}: choose one of {', '.join(BF16_GEMM)}")
    if torch.device(device).type != "cpu":
        return False
    return policy == "fp32" or (policy == "auto" and not cpu_has_native_bf16())


def _bf16_valued(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, held in fp32 (other dtypes untouched)."""
    if x.dtype == torch.float32:
        return x.to(torch.bfloat16).float()
    return x.float() if x.dtype == torch.bfloat16 else x


class _LinearBf16InFp32(torch.autograd.Function):
    """y = x W^T + b as a bf16 GEMM computes it (bf16 operands, fp32 sums, bf16 result), in fp32
    kernels, and so are both gradient products. Its own backward keeps them fp32 even where the
    backward is traced under autocast (torch.compile), which would otherwise cast them to bf16."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(x16, w16)  # what autocast keeps for its bf16 backward
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast("cpu", enabled=False):
            y = F.linear(x16.float(), w16.float(), None if bias is None else _bf16_valued(bias))
        return y.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        x16, w16 = ctx.saved_tensors
        g = grad.float().flatten(0, -2)
        grad_x = grad_w = grad_b = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (g @ w16.float()).to(torch.bfloat16).to(ctx.dtypes[0]).view(*grad.shape[:-1], -1)
            if ctx.needs_input_grad[1]:
                grad_w = (g.T @ x16.float().flatten(0, -2)).to(torch.bfloat16).to(ctx.dtypes[1])
            if ctx.dtypes[2] is not None and ctx.needs_input_grad[2]:
                grad_b = g.sum(0).to(torch.bfloat16).to(ctx.dtypes[2])
        return grad_x, grad_w, grad_b


class Bf16GemmInFp32(TorchFunctionMode):
    """While CPU autocast is on in bf16: `F.linear` (`_LinearBf16InFp32`) and
    `F.scaled_dot_product_attention` (whose backward autocast leaves alone) round their floating
    operands to bf16, compute in fp32 with autocast off, and return bf16, as autocast's bf16 kernels
    would. Outside such an autocast region every call passes through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (F.linear, F.scaled_dot_product_attention) or not _cpu_bf16_autocast():
            return func(*args, **kwargs)
        if func is F.linear:
            x, weight, *rest = args
            return _LinearBf16InFp32.apply(x, weight, rest[0] if rest else kwargs.get("bias"))
        args = tuple(_bf16_valued(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: _bf16_valued(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs).to(torch.bfloat16)


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast runs `device_type`'s matrix products in; None while autocast is off there."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _cpu_bf16_autocast() -> bool:
    return autocast_dtype("cpu") == torch.bfloat16


def mixed_precision(device: torch.device | str, bf16: bool, gemm: str = "auto"):
    """The context a forward runs in: nothing (fp32), bf16 autocast, or on a CPU where `gemm_in_fp32`
    holds, bf16 autocast with `Bf16GemmInFp32`."""
    device = torch.device(device)
    if not bf16:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
    if gemm_in_fp32(gemm, device):
        stack.enter_context(Bf16GemmInFp32())
    return stack


def matmul_dtype(device: torch.device | str, bf16: bool, gemm: str = "auto") -> torch.dtype:
    """The dtype the matrix products actually run in (for the MFU's peak)."""
    return torch.bfloat16 if bf16 and not gemm_in_fp32(gemm, device) else torch.float32
