import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab import precision
from ropelab.config import ModelConfig
from ropelab.model import Transformer
from ropelab.precision import Bf16GemmInFp32, gemm_in_fp32, matmul_dtype, mixed_precision

BF16 = torch.bfloat16


def _emulated(fn, *args, **kwargs):
    with mixed_precision("cpu", True, "fp32"):
        return fn(*args, **kwargs)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 9), k=st.integers(1, 300), m=st.integers(1, 17))
def test_linear_is_a_bf16_gemm_with_fp32_accumulation(seed, n, k, m):
    """bf16-rounded operands, exact products, an fp32 sum rounded once to bf16: off the fp64 product
    of the rounded operands by at most that rounding plus fp32 summation error."""
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(m, generator=g)
    out = _emulated(F.linear, x, w, b)
    assert out.dtype == BF16
    xr, wr, br = (t.to(BF16).double() for t in (x, w, b))
    exact = xr @ wr.T + br
    magnitude = xr.abs() @ wr.abs().T + br.abs()
    bound = 2**-8 * exact.abs() + (k + 1) * 2**-24 * magnitude
    assert ((out.double() - exact).abs() <= bound).all()


def test_not_a_plain_fp32_product():
    """The operands are rounded: with inputs that bf16 cannot hold, the result differs from fp32's."""
    x = torch.full((1, 4), 1.0 + 2**-12)
    w = torch.ones(1, 4)
    assert _emulated(F.linear, x, w).item() == 4.0
    assert F.linear(x, w).item() != 4.0


def test_attention_and_gradients_match_native_bf16():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g, requires_grad=True) for _ in range(3))
    outs, grads = [], []
    for gemm in ("native", "fp32"):
        with mixed_precision("cpu", True, gemm):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.dtype == BF16
        outs.append(out.float())
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    for emulated, native in zip(grads[1], grads[0]):
        assert (emulated - native).norm() <= 0.02 * native.norm()


def test_linear_gradients_are_bf16_products_of_the_rounded_operands():
    """Input, weight and bias gradients of a 3-D input: the fp64 products of the bf16-rounded incoming
    gradient and operands, rounded to bf16 (one rounding step allowed), as PyTorch's bf16 kernels give."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 24, generator=g, requires_grad=True)
    w = torch.randn(7, 24, generator=g, requires_grad=True)
    b = torch.randn(7, generator=g, requires_grad=True)
    upstream = torch.randn(2, 5, 7, generator=g).to(BF16)
    out = _emulated(F.linear, x, w, b)
    gx, gw, gb = torch.autograd.grad(out, (x, w, b), upstream)
    assert gx.dtype == gw.dtype == gb.dtype == torch.float32
    up, xr, wr = upstream.double().flatten(0, 1), x.detach().to(BF16).double().flatten(0, 1), w.detach().to(BF16).double()
    for got, exact in ((gx.flatten(0, 1), up @ wr), (gw, up.T @ xr), (gb, up.sum(0))):
        assert torch.equal(got, got.to(BF16).float())  # rounded to bf16
        torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-6)
    with mixed_precision("cpu", True, "native"):
        native = F.linear(x, w, b)
    for a, n in zip((gx, gw, gb), torch.autograd.grad(native, (x, w, b), upstream)):
        torch.testing.assert_close(a, n, rtol=2**-7, atol=1e-2)


def test_inactive_without_bf16_autocast():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with Bf16GemmInFp32():
        assert torch.equal(F.linear(x, w), F.linear(x, w).detach())
        assert F.linear(x, w).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.float16):
            assert F.linear(x, w).dtype == torch.float16


def test_training_step_matches_native_bf16():
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(ModelConfig.from_name("tiny-llama"), vocab_size=300))
    ids = torch.randint(0, 300, (2, 64))
    results = {}
    for gemm in ("native", "fp32"):
        with mixed_precision("cpu", True, gemm):
            _, loss = model(ids, ids)
        loss.backward()
        results[gemm] = loss.item(), [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
    _, fp32_loss = model(ids, ids)
    (native, native_grads), (emulated, emulated_grads) = results["native"], results["fp32"]
    # a mean over 128 tokens of losses from bf16 logits (8 significant bits: steps of 2^-8 relative) that
    # two kernels round apart: a few such steps, 1e-2 relative
    assert emulated == pytest.approx(native, rel=1e-2)
    assert emulated != fp32_loss.item()  # bf16 arithmetic, not fp32's
    for a, b in zip(emulated_grads, native_grads):
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-6


def test_policy(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert gemm_in_fp32("auto", "cpu") and gemm_in_fp32("fp32", "cpu") and not gemm_in_fp32("native", "cpu")
    assert matmul_dtype("cpu", True) == torch.float32 and matmul_dtype("cpu", False) == torch.float32
    assert matmul_dtype("cpu", True, "native") == BF16
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert not gemm_in_fp32("auto", "cpu") and gemm_in_fp32("fp32", "cpu")
    assert not gemm_in_fp32("fp32", "cuda")
    with pytest.raises(ValueError, match="bf16_gemm='fast'"):
        gemm_in_fp32("fast", "cpu")
