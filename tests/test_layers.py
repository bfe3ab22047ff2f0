"""ropelab.layers: rms_norm, swiglu, residual_add and the fused rms_norm_linear and swiglu_linear give the
plain expressions' values and gradients bit for bit, in fp32, bf16 and mixed (bf16 activations, fp32 weight),
the fused ones under CPU bf16 autocast too (and on a GPU under CUDA autocast, to one rounding), and
keep fewer tensors for backward.

On CPU the layers run the C loops of `ropelab.layer_kernels` where they apply; those round where the
plain expressions round but compute exp and sums their own way, so against the plain expressions they
are tested to one rounding (fixture `cpu_kernel`), and bit for bit with the loops switched off. The
fused layers and the unfused ones share the loops, so they stay bit-identical either way."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from ropelab import layer_kernels
from ropelab.layers import residual_add, rms_norm, rms_norm_linear, swiglu, swiglu_, swiglu_linear
from ropelab.precision import Bf16GemmInFp32

DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "bf16-x-fp32-weight": (torch.bfloat16, torch.float32)}


@pytest.fixture(params=["kernel", "torch"])
def cpu_kernel(request, monkeypatch):
    """The layers with the C loops ("kernel", where a compiler built them) and without ("torch")."""
    if request.param == "torch":
        monkeypatch.setattr(layer_kernels, "library", lambda: None)
    elif layer_kernels.library() is None:
        pytest.skip("the C loops are unavailable here (no compiler, or ROPELAB_CPU_KERNEL=0)")
    return request.param == "kernel"


def assert_matches_plain(ours, plain, kernel: bool, rounding_dtype: torch.dtype):
    """ours equals the plain expression's value: bit for bit on the torch path; with the C loops, to one
    rounding of `rounding_dtype` (the coarsest dtype the expression rounds to) at the tensor's scale, as
    exp and the sums differ there in their last bit."""
    assert ours.dtype == plain.dtype and ours.shape == plain.shape
    if not kernel:
        assert torch.equal(ours, plain)
        return
    eps = torch.finfo(rounding_dtype).eps
    if rounding_dtype == torch.float32:
        eps *= 16  # sums over a row or over tokens, in another order
    torch.testing.assert_close(ours, plain, rtol=eps, atol=eps * plain.abs().max().item())


def plain_rms_norm(x, weight, eps):
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def plain_swiglu(gate, up):
    return F.silu(gate) * up


def values_and_grads(fn, inputs, seed=1, context=contextlib.nullcontext, backward_context=contextlib.nullcontext):
    """fn(*inputs) (one tensor or a tuple of them) run inside `context()` and the gradient of every input
    that requires one, for a random upstream gradient of each output (backward inside `backward_context()`)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    with context():
        out = fn(*leaves)
    outs = (out,) if isinstance(out, torch.Tensor) else out
    gen = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    with backward_context():
        torch.autograd.backward(outs, upstream)
    return out, [t.grad for t in leaves if t is not None and t.requires_grad]


def cpu_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def saved_bytes(fn, inputs, context=contextlib.nullcontext) -> int:
    """Bytes of the distinct tensors autograd keeps for backward of fn(*inputs) run inside `context()`,
    the inputs included."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context():
        fn(*leaves)
    return sum(storages.values())


@pytest.mark.parametrize("shape", [(3, 17, 48), (2, 4, 9, 16)], ids=["block", "qk-norm"])
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
def test_rms_norm_equals_the_plain_expression(dtypes, shape, cpu_kernel):
    x_dtype, w_dtype = DTYPES[dtypes]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(x_dtype)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(w_dtype)
    inputs = (x.requires_grad_(), weight.requires_grad_())
    ours, ours_grads = values_and_grads(lambda a, w: rms_norm(a, w, 1e-5), inputs)
    plain, plain_grads = values_and_grads(lambda a, w: plain_rms_norm(a, w, 1e-5), inputs)
    for a, b in zip([ours, *ours_grads], [plain, *plain_grads], strict=True):
        assert_matches_plain(a, b, cpu_kernel, x_dtype)


def test_rms_norm_with_a_frozen_weight_or_input(cpu_kernel):
    x = torch.randn(4, 32)
    weight = 1 + 0.1 * torch.randn(32)
    for needs in ((True, False), (False, True)):
        inputs = (x.clone().requires_grad_(needs[0]), weight.clone().requires_grad_(needs[1]))
        _, ours = values_and_grads(lambda a, w: rms_norm(a, w, 1e-6), inputs)
        _, plain = values_and_grads(lambda a, w: plain_rms_norm(a, w, 1e-6), inputs)
        assert len(ours) == 1
        assert_matches_plain(ours[0], plain[0], cpu_kernel, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_equals_the_plain_expression(dtype, cpu_kernel):
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(3, 17, 80, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    ours, ours_grads = values_and_grads(swiglu, (gate, up))
    plain, plain_grads = values_and_grads(plain_swiglu, (gate, up))
    for a, b in zip([ours, *ours_grads], [plain, *plain_grads], strict=True):
        assert_matches_plain(a, b, cpu_kernel, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_place_swiglu_writes_swiglus_values_over_gate(dtype, cpu_kernel):
    gen = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(2, 9, 40, generator=gen).to(dtype) for _ in range(2))
    expected = swiglu(gate, up)
    out = swiglu_(gate, up)
    assert out.data_ptr() == gate.data_ptr() and torch.equal(out, expected)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)], ids=["fp32+bf16", "fp32", "bf16"])
def test_residual_add_is_x_plus_branch_bit_for_bit(dtypes, cpu_kernel):
    """Exact on either path: widening bf16 to float32 is exact, and the one add rounds as torch's does."""
    gen = torch.Generator().manual_seed(3)
    x, branch = (torch.randn(2, 7, 48, generator=gen).mul(100).to(dtype).requires_grad_() for dtype in dtypes)
    ours, ours_grads = values_and_grads(residual_add, (x, branch))
    plain, plain_grads = values_and_grads(torch.add, (x, branch))
    for a, b in zip([ours, *ours_grads], [plain, *plain_grads], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert saved_bytes(residual_add, (x, branch)) == saved_bytes(torch.add, (x, branch)) == 0


def test_residual_add_under_autocast_is_autocasts_own_sum():
    """A block's residual add under CPU bf16 autocast: the bf16 product added to the float32 stream."""
    gen = torch.Generator().manual_seed(4)
    x, h, weight = torch.randn(3, 5, 32, generator=gen), torch.randn(3, 5, 32, generator=gen), torch.randn(32, 32)
    inputs = (x.requires_grad_(), h.requires_grad_(), weight.requires_grad_())
    ours, ours_grads = values_and_grads(lambda a, b, w: residual_add(a, F.linear(b, w)), inputs, context=cpu_autocast)
    plain, plain_grads = values_and_grads(lambda a, b, w: a + F.linear(b, w), inputs, context=cpu_autocast)
    assert ours.dtype == torch.float32
    for a, b in zip([ours, *ours_grads], [plain, *plain_grads], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_they_keep_fewer_tensors_for_backward():
    x, weight = torch.randn(8, 64, 96), torch.ones(96)
    x_bytes = x.numel() * 4
    # plain: x and the normalised x; lean: x and the (8, 64, 1) rstd (and the weight, which both keep)
    assert saved_bytes(lambda a, w: plain_rms_norm(a, w, 1e-5), (x, weight)) >= 2 * x_bytes
    assert saved_bytes(lambda a, w: rms_norm(a, w, 1e-5), (x, weight)) == x_bytes + 8 * 64 * 4 + 96 * 4
    gate, up = torch.randn(8, 64, 96), torch.randn(8, 64, 96)
    assert saved_bytes(plain_swiglu, (gate, up)) == 3 * x_bytes  # gate, silu(gate), up
    assert saved_bytes(swiglu, (gate, up)) == 2 * x_bytes  # gate, up


def plain_norm_linears(x, norm_weight, *params):
    normed = rms_norm(x, norm_weight, 1e-5)
    return tuple(F.linear(normed, w, b) for w, b in zip(params[0::2], params[1::2]))


def norm_linears(x, norm_weight, *params):
    return rms_norm_linear(x, norm_weight, 1e-5, list(zip(params[0::2], params[1::2])))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_norm_linear_and_swiglu_linear_equal_the_plain_layers_bit_for_bit(dtype, bias, cpu_kernel):
    gen = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    params = [t for out in (32, 16, 16) for t in (tensor(out, 48), tensor(out) if bias else None)]
    inputs = (tensor(3, 17, 48), tensor(48), *params)
    ours, ours_grads = values_and_grads(norm_linears, inputs)
    plain, plain_grads = values_and_grads(plain_norm_linears, inputs)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain, strict=True))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours_grads, plain_grads, strict=True))

    inputs = (tensor(3, 17, 40), tensor(3, 17, 40), tensor(24, 40), tensor(24) if bias else None)
    ours, ours_grads = values_and_grads(swiglu_linear, inputs)
    plain, plain_grads = values_and_grads(lambda g, u, w, b: F.linear(swiglu(g, u), w, b), inputs)
    assert torch.equal(ours, plain)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours_grads, plain_grads, strict=True))


# (shape of x and of gate and up, x's dtype, gate's and up's dtype, biases), the weights fp32 as autocast
# has them: the model's case (an fp32 residual into the norm, bf16 gate and up out of autocast's
# projections), others that autocast casts too (bf16 x, fp32 gate and up), odd widths
AUTOCAST_CASES = {
    "model": ((3, 17, 48), torch.float32, torch.bfloat16, False),
    "model-bias": ((3, 17, 48), torch.float32, torch.bfloat16, True),
    "bf16-x": ((2, 4, 9, 24), torch.bfloat16, torch.bfloat16, True),
    "fp32-gate-up": ((5, 40), torch.float32, torch.float32, False),
    "odd-widths": ((1, 3, 37), torch.float32, torch.bfloat16, True),
}


def autocast_inputs(case: str, device: str = "cpu"):
    """(inputs of norm_linears, inputs of swiglu_linear) for one of AUTOCAST_CASES."""
    shape, x_dtype, gate_dtype, bias = AUTOCAST_CASES[case]
    gen = torch.Generator().manual_seed(sum(shape))
    C = shape[-1]

    def tensor(*size, dtype=torch.float32, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*size, generator=gen)).to(device, dtype).requires_grad_()

    def linear(out):
        return tensor(out, C, scale=C ** -0.5), tensor(out) if bias else None

    norm = (tensor(*shape, dtype=x_dtype, scale=3.0), tensor(C, scale=0.3, shift=1.0),
            *linear(C + 8), *linear(C // 2), *linear(C // 2))
    mlp = (tensor(*shape, dtype=gate_dtype), tensor(*shape, dtype=gate_dtype), *linear(C - 5))
    return norm, mlp


def plain_swiglu_linear(gate, up, weight, bias):
    return F.linear(swiglu(gate, up), weight, bias)


@pytest.mark.parametrize("case", sorted(AUTOCAST_CASES))
def test_fused_layers_under_autocast_equal_autocasts_own_plain_expressions_bit_for_bit(case, cpu_kernel):
    """Under CPU bf16 autocast (backward outside it, as a training step runs): bf16 outputs, and the
    gradients of x, the norm weight, gate, up, every weight and bias in their own dtypes, all equal to
    what autograd computes for the plain expressions that autocast casts."""
    for fused, plain, inputs in zip((norm_linears, swiglu_linear), (plain_norm_linears, plain_swiglu_linear),
                                    autocast_inputs(case), strict=True):
        ours, ours_grads = values_and_grads(fused, inputs, context=cpu_autocast)
        expected, expected_grads = values_and_grads(plain, inputs, context=cpu_autocast)
        ours, expected = (out if isinstance(out, tuple) else (out,) for out in (ours, expected))
        for a, b in zip(ours, expected, strict=True):
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
        assert len(ours_grads) == sum(t is not None for t in inputs)
        for a, b, t in zip(ours_grads, expected_grads, [t for t in inputs if t is not None], strict=True):
            assert a.dtype == b.dtype == t.dtype and torch.equal(a, b)


def test_fused_layers_take_autocasts_state_from_their_forward():
    """A backward run inside another autocast (fp16) casts as the bf16 forward did."""
    for fused, inputs in zip((norm_linears, swiglu_linear), autocast_inputs("model-bias"), strict=True):
        expected = values_and_grads(fused, inputs, context=cpu_autocast)[1]
        got = values_and_grads(fused, inputs, context=cpu_autocast,
                               backward_context=lambda: torch.autocast("cpu", dtype=torch.float16))[1]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(AUTOCAST_CASES))
def test_fused_layers_under_cuda_autocast_equal_its_plain_expressions(case, dtype):
    """The same code under CUDA autocast: outputs and every gradient to one rounding of the autocast
    dtype (cuBLAS may pick other kernels for the fused layers' products than for the plain ones)."""
    eps = torch.finfo(dtype).eps

    def context():
        return torch.autocast("cuda", dtype=dtype)

    for fused, plain, inputs in zip((norm_linears, swiglu_linear), (plain_norm_linears, plain_swiglu_linear),
                                    autocast_inputs(case, "cuda"), strict=True):
        ours, ours_grads = values_and_grads(fused, inputs, context=context)
        expected, expected_grads = values_and_grads(plain, inputs, context=context)
        ours, expected = (out if isinstance(out, tuple) else (out,) for out in (ours, expected))
        for a, b in zip([*ours, *ours_grads], [*expected, *expected_grads], strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().max().item())
        assert all(o.dtype == dtype for o in ours)


def test_fused_layers_keep_x_and_rstd_or_gate_and_up_only():
    x, weight = torch.randn(8, 64, 96), torch.ones(96)
    projections = [torch.randn(40, 96), None, torch.randn(24, 96), None]
    x_bytes, rstd_bytes = x.numel() * 4, 8 * 64 * 4
    weights_bytes = 96 * 4 + (40 + 24) * 96 * 4
    # plain: the norm keeps x and rstd, each projection the normalised x (one tensor, shared)
    assert saved_bytes(plain_norm_linears, (x, weight, *projections)) == 2 * x_bytes + rstd_bytes + weights_bytes
    assert saved_bytes(norm_linears, (x, weight, *projections)) == x_bytes + rstd_bytes + weights_bytes
    gate, up, down = torch.randn(8, 64, 96), torch.randn(8, 64, 96), torch.randn(40, 96)
    down_bytes = down.numel() * 4
    assert saved_bytes(lambda g, u, w: F.linear(swiglu(g, u), w), (gate, up, down)) == 3 * x_bytes + down_bytes
    assert saved_bytes(lambda g, u, w: swiglu_linear(g, u, w, None), (gate, up, down)) == 2 * x_bytes + down_bytes


def test_fused_layers_keep_x_and_rstd_or_gate_and_up_only_under_autocast():
    """Under bf16 autocast the plain expressions keep, per projection, autocast's bf16 cast of its input
    and of its weight; the fused ones keep x and rstd (gate and up) instead of the inputs, and the same
    bf16 weights."""
    x, weight = torch.randn(8, 64, 96), torch.ones(96)
    projections = [torch.randn(40, 96), None, torch.randn(24, 96), None]
    x_bytes, rstd_bytes, norm_bytes = x.numel() * 4, 8 * 64 * 4, 96 * 4
    projection_values = (40 + 24) * 96
    # plain: x, rstd and the norm's weight, then a bf16 normalised x and a bf16 weight per projection
    assert saved_bytes(plain_norm_linears, (x, weight, *projections), cpu_autocast) == (
        x_bytes + rstd_bytes + norm_bytes + 2 * (x_bytes // 2) + projection_values * 2)
    assert saved_bytes(norm_linears, (x, weight, *projections), cpu_autocast) == (
        x_bytes + rstd_bytes + norm_bytes + projection_values * 2)
    gate, up = torch.randn(8, 64, 96).bfloat16(), torch.randn(8, 64, 96).bfloat16()
    down = torch.randn(40, 96)
    g_bytes, down_bytes = gate.numel() * 2, down.numel() * 4
    # plain: gate, up, silu(gate) * up and the bf16 weight
    assert saved_bytes(lambda g, u, w: F.linear(swiglu(g, u), w), (gate, up, down), cpu_autocast) == (
        3 * g_bytes + down_bytes // 2)
    assert saved_bytes(lambda g, u, w: swiglu_linear(g, u, w, None), (gate, up, down), cpu_autocast) == (
        2 * g_bytes + down_bytes // 2)


def test_fused_layers_run_the_plain_expressions_without_gradients_or_under_a_function_mode():
    """Without gradients, and under CPU autocast with a torch-function mode (Bf16GemmInFp32, which
    moves autocast's matrix products to fp32 kernels that the fused backward would not follow)."""
    x, weight, w = torch.randn(2, 5, 16), torch.randn(16), torch.randn(8, 16)
    with torch.no_grad():
        assert torch.equal(rms_norm_linear(x, weight, 1e-5, [(w, None)])[0], F.linear(rms_norm(x, weight, 1e-5), w))
    leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), Bf16GemmInFp32():
        (out,) = rms_norm_linear(leaf, weight, 1e-5, [(w, None)])
        down = swiglu_linear(out, out, w.t().contiguous(), None)
    assert out.dtype == down.dtype == torch.bfloat16  # autocast's casts, recorded by autograd as usual
    assert "RMSNormLinear" not in type(out.grad_fn).__name__ and "SwiGLULinear" not in type(down.grad_fn).__name__
    down.float().sum().backward()
    assert leaf.grad is not None and leaf.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = rms_norm_linear(leaf, weight, 1e-5, [(w, None)])
        down = swiglu_linear(out, out, w.t().contiguous(), None)
    assert "RMSNormLinear" in type(out.grad_fn).__name__ and "SwiGLULinear" in type(down.grad_fn).__name__
