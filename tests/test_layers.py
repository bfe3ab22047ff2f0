"""ropelab.layers: rms_norm, swiglu and the fused rms_norm_linear and swiglu_linear give the plain
expressions' values and gradients bit for bit, in fp32, bf16 and mixed (bf16 activations, fp32 weight:
autocast), and keep fewer tensors for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ropelab.layers import rms_norm, rms_norm_linear, swiglu, swiglu_linear

DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "bf16-x-fp32-weight": (torch.bfloat16, torch.float32)}


def plain_rms_norm(x, weight, eps):
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def plain_swiglu(gate, up):
    return F.silu(gate) * up


def values_and_grads(fn, inputs, seed=1):
    """fn(*inputs) (one tensor or a tuple of them) and the gradient of every input that requires one,
    for a random upstream gradient of each output."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)
    outs = (out,) if isinstance(out, torch.Tensor) else out
    gen = torch.Generator().manual_seed(seed)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs])
    return out, [t.grad for t in leaves if t is not None and t.requires_grad]


def saved_bytes(fn, inputs) -> int:
    """Bytes of the distinct tensors autograd keeps for backward of fn(*inputs), the inputs included."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return sum(storages.values())


@pytest.mark.parametrize("shape", [(3, 17, 48), (2, 4, 9, 16)], ids=["block", "qk-norm"])
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
def test_rms_norm_equals_the_plain_expression_bit_for_bit(dtypes, shape):
    x_dtype, w_dtype = DTYPES[dtypes]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(x_dtype)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(w_dtype)
    inputs = (x.requires_grad_(), weight.requires_grad_())
    ours, ours_grads = values_and_grads(lambda a, w: rms_norm(a, w, 1e-5), inputs)
    plain, plain_grads = values_and_grads(lambda a, w: plain_rms_norm(a, w, 1e-5), inputs)
    assert ours.dtype == plain.dtype and torch.equal(ours, plain)
    for a, b in zip(ours_grads, plain_grads, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_rms_norm_with_a_frozen_weight_or_input():
    x = torch.randn(4, 32)
    weight = 1 + 0.1 * torch.randn(32)
    for needs in ((True, False), (False, True)):
        inputs = (x.clone().requires_grad_(needs[0]), weight.clone().requires_grad_(needs[1]))
        _, ours = values_and_grads(lambda a, w: rms_norm(a, w, 1e-6), inputs)
        _, plain = values_and_grads(lambda a, w: plain_rms_norm(a, w, 1e-6), inputs)
        assert len(ours) == 1 and torch.equal(ours[0], plain[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_equals_the_plain_expression_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(3, 17, 80, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    ours, ours_grads = values_and_grads(swiglu, (gate, up))
    plain, plain_grads = values_and_grads(plain_swiglu, (gate, up))
    assert ours.dtype == plain.dtype and torch.equal(ours, plain)
    for a, b in zip(ours_grads, plain_grads, strict=True):
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
def test_fused_norm_linear_and_swiglu_linear_equal_the_plain_layers_bit_for_bit(dtype, bias):
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


def test_fused_layers_run_the_plain_expressions_under_autocast_and_without_gradients():
    x, weight, w = torch.randn(2, 5, 16), torch.randn(16), torch.randn(8, 16)
    with torch.no_grad():
        assert torch.equal(rms_norm_linear(x, weight, 1e-5, [(w, None)])[0], F.linear(rms_norm(x, weight, 1e-5), w))
    leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = rms_norm_linear(leaf, weight, 1e-5, [(w, None)])
        down = swiglu_linear(out, out, w.t().contiguous(), None)
    assert out.dtype == down.dtype == torch.bfloat16  # autocast's casts, recorded by autograd as usual
    assert "RMSNormLinear" not in type(out.grad_fn).__name__ and "SwiGLULinear" not in type(down.grad_fn).__name__
    down.float().sum().backward()
    assert leaf.grad is not None and leaf.grad.dtype == torch.float32
