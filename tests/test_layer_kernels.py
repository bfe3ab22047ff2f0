"""ropelab.layer_kernels: the C loops for SwiGLU and RMSNorm give torch's values to one rounding (bit for
bit wherever torch's exp and sums are not involved), the residual add gives them bit for bit, all keep
torch's special values, give the same bits run to run, and decline what they cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab import layer_kernels

pytestmark = pytest.mark.skipif(layer_kernels.library() is None,
                                reason="the C loops are unavailable here (no compiler, or ROPELAB_CPU_KERNEL=0)")
BF16_EPS = torch.finfo(torch.bfloat16).eps


def every_bf16() -> torch.Tensor:
    """All 65,536 bf16 values, NaNs and infinities included."""
    return torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def assert_same_specials(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = theirs.isfinite()
    assert torch.equal(ours[~finite & ~theirs.isnan()], theirs[~finite & ~theirs.isnan()])


def test_swiglu_on_every_bf16_value_is_torchs_or_one_rounding_away():
    gate = every_bf16()
    for up in (torch.ones_like(gate), torch.full_like(gate, -3.0)):
        ours, theirs = layer_kernels.swiglu_loop(gate, up), F.silu(gate) * up
        assert_same_specials(ours, theirs)
        both = ours.isfinite() & theirs.isfinite()
        a, b = ours[both].float(), theirs[both].float()
        assert torch.all((a - b).abs() <= BF16_EPS * b.abs())  # one bf16 ulp at most
        assert (a != b).float().mean() < 0.01  # and nearly always the same bits


def test_swiglu_into_its_gate_gives_the_same_values():
    gate, up = torch.randn(5, 1000).bfloat16(), torch.randn(5, 1000).bfloat16()
    expected = layer_kernels.swiglu_loop(gate, up)
    assert layer_kernels.swiglu_loop(gate, up, out=gate) is gate and torch.equal(gate, expected)
    assert layer_kernels.swiglu_loop(gate, up, out=torch.empty(5, 1000)) is None  # out in another dtype


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_swiglu_fp32_follows_torch_on_any_float(values):
    gate = torch.tensor(values, dtype=torch.float32)
    up = torch.linspace(-2, 2, len(values))
    ours, theirs = layer_kernels.swiglu_loop(gate, up), F.silu(gate) * up
    assert_same_specials(ours, theirs)
    both = ours.isfinite() & theirs.isfinite()
    torch.testing.assert_close(ours[both], theirs[both], rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_backward_follows_torchs_ops(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = ((torch.randn(3, 33, 130, generator=gen) * scale).to(dtype) for scale in (4, 1, 1))
    hidden, grad_gate, grad_up = layer_kernels.swiglu_backward_loop(gate, up, grad, True)
    silu = F.silu(gate)
    expected = (silu * up, torch.ops.aten.silu_backward((grad * up).to(dtype), gate), grad * silu)
    eps = BF16_EPS if dtype == torch.bfloat16 else 4 * torch.finfo(torch.float32).eps
    for ours, theirs in zip((hidden, grad_gate, grad_up), expected, strict=True):
        assert ours.dtype == dtype
        # grad_gate's (1 + g (1 - s)) cancels near g = -1.28: an ulp of the terms, not of the result
        torch.testing.assert_close(ours, theirs, rtol=eps, atol=eps * theirs.abs().max().item())
    assert layer_kernels.swiglu_backward_loop(gate, up, grad, False)[0] is None
    assert all(torch.equal(a, b) for a, b in zip(layer_kernels.swiglu_backward_loop(gate, up, grad, False)[1:],
                                                 (grad_gate, grad_up), strict=True))


def torch_rms_norm(x, weight, eps, out_dtype):
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight * (x.float() * rstd).to(x.dtype)).to(out_dtype), rstd


# (x, weight, output): fp32; under bf16 autocast (fp32 residual and weight, bf16 out); a bf16 model;
# bf16 activations with an fp32 weight
NORM_DTYPES = {"fp32": (torch.float32, torch.float32, torch.float32),
               "autocast": (torch.float32, torch.float32, torch.bfloat16),
               "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
               "bf16-x-fp32-weight": (torch.bfloat16, torch.float32, torch.float32)}


def norm_inputs(x_dtype, w_dtype, rows=(2, 37), width=72):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(*rows, width, generator=gen) * 3).to(x_dtype)
    weight = (1 + 0.3 * torch.randn(width, generator=gen)).to(w_dtype)
    return x, weight


def rounding_of(*dtypes) -> float:
    return BF16_EPS if torch.bfloat16 in dtypes else 16 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtypes", sorted(NORM_DTYPES))
def test_rms_norm_follows_torch_and_reuses_its_rstd(dtypes):
    x_dtype, w_dtype, out_dtype = NORM_DTYPES[dtypes]
    x, weight = norm_inputs(x_dtype, w_dtype)
    x[0, 3] = 0.0  # a row of zeros: rstd = 1 / sqrt(eps)
    out, rstd = layer_kernels.rms_norm_loop(x, weight, 1e-5, out_dtype)
    expected, expected_rstd = torch_rms_norm(x, weight, 1e-5, out_dtype)
    assert out.dtype == out_dtype and rstd.shape == (2, 37, 1) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, expected_rstd, rtol=4e-7, atol=0)
    eps = rounding_of(x_dtype, out_dtype)
    torch.testing.assert_close(out, expected, rtol=eps, atol=eps * expected.abs().max().item())
    again, same = layer_kernels.rms_norm_loop(x, weight, 1e-5, out_dtype, rstd)
    assert same is rstd and torch.equal(again, out)
    assert torch.equal(layer_kernels.rms_norm_loop(x, weight, 1e-5, out_dtype)[0], out)  # run to run


def torch_rms_norm_backward(parts, x, weight, rstd):
    dtype = torch.promote_types(weight.dtype, x.dtype)
    grad = parts[-1].to(dtype)
    for part in reversed(parts[:-1]):
        grad = grad + part.to(dtype)
    xf = x.float()
    grad_weight = (grad * (xf * rstd).to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
    g = (grad * weight).to(x.dtype).float()
    grad_rstd = -0.5 * (g * xf).sum(-1, keepdim=True) * rstd.pow(3)
    return (g * rstd + grad_rstd / x.shape[-1] * (2 * xf)).to(x.dtype), grad_weight


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("dtypes", sorted(NORM_DTYPES))
def test_rms_norm_backward_follows_torch(dtypes, count):
    x_dtype, w_dtype, out_dtype = NORM_DTYPES[dtypes]
    x, weight = norm_inputs(x_dtype, w_dtype)
    _, rstd = torch_rms_norm(x, weight, 1e-5, out_dtype)
    gen = torch.Generator().manual_seed(2)
    parts = [torch.randn(x.shape, generator=gen).to(out_dtype) for _ in range(count)]
    grad_x, grad_weight = layer_kernels.rms_norm_backward_loop(parts, x, weight, rstd, True, True)
    expected_x, expected_weight = torch_rms_norm_backward(parts, x, weight, rstd)
    eps = rounding_of(x_dtype, w_dtype, out_dtype)
    for ours, theirs in ((grad_x, expected_x), (grad_weight, expected_weight)):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=eps, atol=eps * theirs.abs().max().item())
    only_x = layer_kernels.rms_norm_backward_loop(parts, x, weight, rstd, True, False)
    only_weight = layer_kernels.rms_norm_backward_loop(parts, x, weight, rstd, False, True)
    assert only_x[1] is None and torch.equal(only_x[0], grad_x)
    assert only_weight[0] is None and torch.equal(only_weight[1], grad_weight)


def test_rms_norm_backward_at_one_thread_or_two():
    """The weight gradient sums per-thread partial sums: another thread count, another order (one
    fp32 rounding); the input gradient is per row, so the same bits."""
    x, weight = norm_inputs(torch.float32, torch.float32, rows=(4, 512), width=96)
    _, rstd = torch_rms_norm(x, weight, 1e-5, torch.float32)
    parts = [torch.randn(x.shape, generator=torch.Generator().manual_seed(3))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer_kernels.rms_norm_backward_loop(parts, x, weight, rstd, True, True)
        torch.set_num_threads(2)
        two = layer_kernels.rms_norm_backward_loop(parts, x, weight, rstd, True, True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0])
    torch.testing.assert_close(one[1], two[1], rtol=1e-5, atol=1e-5 * one[1].abs().max().item())


def test_add_widened_is_torchs_mixed_add_on_every_bf16_branch_value():
    branch = every_bf16()
    x = torch.randn(branch.shape, generator=torch.Generator().manual_seed(5)) * 4
    x[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 3.4e38])
    x[-3:] = torch.tensor([1e-40, -1e-45, 0.0])  # float32 subnormals beside bf16 ones
    ours, theirs = layer_kernels.add_widened_loop(x, branch), x + branch
    assert ours.dtype == torch.float32
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~theirs.isnan()], theirs[~theirs.isnan()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_widened_in_place_gives_torchs_sums_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(5)
    total, part = torch.randn(300, 70, generator=gen), torch.randn(300, 70, generator=gen).to(dtype)
    expected = total.clone().add_(part)
    assert layer_kernels.add_widened_loop(total, part, out=total) is total and torch.equal(total, expected)
    assert layer_kernels.add_widened_loop(total, part, out=part.bfloat16()) is None  # only into float32
    assert layer_kernels.add_widened_loop(total.bfloat16(), part) is None


def test_empty_inputs():
    x, weight = torch.empty(0, 8), torch.ones(8)
    out, rstd = layer_kernels.rms_norm_loop(x, weight, 1e-5, torch.float32)
    assert out.shape == (0, 8) and rstd.shape == (0, 1)
    grad_x, grad_weight = layer_kernels.rms_norm_backward_loop([x], x, weight, rstd, True, True)
    assert grad_x.shape == (0, 8) and torch.equal(grad_weight, torch.zeros(8))
    assert layer_kernels.swiglu_loop(x, x).shape == (0, 8)


def test_what_the_loops_decline():
    x, weight = norm_inputs(torch.float32, torch.float32)
    assert layer_kernels.rms_norm_loop(x.transpose(0, 1), weight, 1e-5, torch.float32) is None  # not contiguous
    assert layer_kernels.rms_norm_loop(x.double(), weight.double(), 1e-5, torch.float64) is None
    assert layer_kernels.rms_norm_loop(x, weight, 1e-5, torch.float16) is None
    assert layer_kernels.rms_norm_loop(x, weight[:-1], 1e-5, torch.float32) is None
    _, rstd = torch_rms_norm(x, weight, 1e-5, torch.float32)
    assert layer_kernels.rms_norm_backward_loop([x, x.bfloat16()], x, weight, rstd, True, True) is None  # mixed parts
    assert layer_kernels.rms_norm_backward_loop([], x, weight, rstd, True, True) is None
    gate = torch.randn(4, 6)
    assert layer_kernels.swiglu_loop(gate, gate.bfloat16()) is None
    assert layer_kernels.swiglu_loop(gate, gate[:, :3]) is None
    assert layer_kernels.swiglu_backward_loop(gate, gate, gate.t().contiguous().t(), True) is None
    assert layer_kernels.add_widened_loop(gate.bfloat16(), gate.bfloat16()) is None
    assert layer_kernels.add_widened_loop(gate, gate[:, :3].bfloat16()) is None
    assert layer_kernels.add_widened_loop(gate.t(), gate.t().bfloat16()) is None  # not contiguous
