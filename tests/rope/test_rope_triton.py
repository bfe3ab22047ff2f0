"""The Triton RoPE kernel (`ropelab.rope.triton_kernel`) against the reference rotation: values, gradients
through `PartialRotary`, pass-through channels, every angle source, both layouts.

Runs on CUDA where there is one; otherwise in Triton's interpreter on CPU tensors. Skipped when
Triton is not installed (it is not a ropelab dependency). The interpreter rounds float32 to
bfloat16 toward zero where GPUs round to nearest, so bfloat16 is compared to one bfloat16 step."""

from __future__ import annotations

import functools
import importlib
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ropelab.rope import apply_partial_rope, inverse_frequencies, rope_angles, rotate, rotate_in_place  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, T, C, H, K, D = 2, 37, 24, 4, 2, 32  # T > the kernel's token block: two blocks, the second partial
DIMS = {"0.1": 2, "0.25": 8, "1.0": 32}


@pytest.fixture(scope="module")
def kernel():
    """ropelab.rope.triton_kernel, imported for the interpreter when there is no GPU (and restored after)."""
    import ropelab.rope.triton_kernel as module

    if DEVICE == "cuda":
        yield module
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield importlib.reload(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
        importlib.reload(module)


def _angles(kind: str, positions: torch.Tensor, inv_freq: torch.Tensor) -> dict:
    """Keyword arguments of `rotate_qk_` for one angle source, and the cos/sin they stand for."""
    if kind == "cos_sin":
        cos, sin = (t.unsqueeze(1) for t in rope_angles(positions, inv_freq))
        return {"cos": cos, "sin": sin}
    if kind == "table":
        cos_table, sin_table = rope_angles(torch.arange(int(positions.max()) + 1, device=DEVICE), inv_freq)
        return {"positions": positions, "cos_table": cos_table, "sin_table": sin_table}
    return {"positions": positions, "inv_freq": inv_freq}


def _qk(dtype, seed=0):
    """q as `Attention` makes it (a transposed view of (B, T, H, D)), k contiguous."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    k = torch.randn(B, K, T, D, generator=g).to(dtype).to(DEVICE)
    return q, k


@pytest.mark.parametrize("angles", ["cos_sin", "table", "frequencies"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("spec", list(DIMS))
def test_kernel_matches_reference(kernel, spec, layout, angles):
    r = DIMS[spec]
    q, k = _qk(torch.float32)
    positions = torch.randint(0, 5000, (B, T), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    inv_freq = inverse_frequencies(r, D, 500.0)
    cos, sin = (t.unsqueeze(1) for t in rope_angles(positions, inv_freq))
    q_out, k_out = q.clone().transpose(1, 2).contiguous().transpose(1, 2), k.clone()  # same strides as q, k
    assert kernel.supports(q_out, k_out, positions)
    kernel.rotate_qk_(q_out, k_out, rotary_dims=r, layout=layout, **_angles(angles, positions, inv_freq))
    for out, x in ((q_out, q), (k_out, k)):
        torch.testing.assert_close(out[..., :r], rotate(x[..., :r], cos, sin, layout), rtol=1e-5, atol=2e-6)
        assert torch.equal(out[..., r:], x[..., r:])
    kernel.rotate_qk_(q_out, k_out, rotary_dims=r, layout=layout, inverse=True, **_angles(angles, positions, inv_freq))
    torch.testing.assert_close(q_out, q, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(k_out, k, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_kernel_bfloat16(kernel, layout):
    q, k = _qk(torch.bfloat16)
    positions = torch.arange(T, device=DEVICE).expand(B, T)
    inv_freq = inverse_frequencies(8, D, 1e4)
    cos, sin = (t.unsqueeze(1) for t in rope_angles(positions, inv_freq))
    q_out, k_out = q.clone(), k.clone()
    kernel.rotate_qk_(q_out, k_out, rotary_dims=8, layout=layout, positions=positions, inv_freq=inv_freq)
    for out, x in ((q_out, q), (k_out, k)):
        expected = rotate(x[..., :8], cos, sin, layout)
        step = 2.0 ** (torch.floor(torch.log2(expected.float().abs().clamp_min(1e-30))) - 7)  # one bf16 step
        assert ((out[..., :8].float() - expected.float()).abs() <= step).all()
        assert torch.equal(out[..., 8:], x[..., 8:])


def test_angles_beyond_float32_positions(kernel):
    """Positions near 2^30: the kernel reduces the angle in float64, like `rope_angles`."""
    r = 16
    q, k = _qk(torch.float32)
    positions = (2**30 + torch.arange(T, device=DEVICE) * 977).expand(B, T)
    inv_freq = inverse_frequencies(r, D, 1e4)
    cos, sin = (t.unsqueeze(1) for t in rope_angles(positions, inv_freq))
    q_out, k_out = q.clone(), k.clone()
    kernel.rotate_qk_(q_out, k_out, rotary_dims=r, layout="half", positions=positions, inv_freq=inv_freq)
    torch.testing.assert_close(q_out[..., :r], rotate(q[..., :r], cos, sin), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("angles", ["table", "frequencies"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("spec", ["0.25", "1.0"])
def test_gradients_through_partial_rotary(kernel, spec, layout, angles):
    """PartialRotary with the Triton rotation, on projection views as in `Attention`: values and
    gradients (input, projection weights) equal the out-of-place reference's."""
    r = DIMS[spec]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, C, generator=g).to(DEVICE).requires_grad_()
    wq = (torch.randn(H * D, C, generator=g) / C**0.5).to(DEVICE).requires_grad_()
    wk = (torch.randn(K * D, C, generator=g) / C**0.5).to(DEVICE).requires_grad_()
    positions = torch.randint(0, 4000, (B, T), generator=g).to(DEVICE)
    upstream = torch.randn(B, H, T, D, generator=g).to(DEVICE), torch.randn(B, K, T, D, generator=g).to(DEVICE)
    inv_freq = inverse_frequencies(r, D, 500.0)
    cos, sin = (t.unsqueeze(1) for t in rope_angles(positions, inv_freq))
    results = []
    for fast in (True, False):
        q = F.linear(x, wq).view(B, T, H, D).transpose(1, 2)
        k = F.linear(x, wk).view(B, T, K, D).transpose(1, 2)
        if fast:
            rotation = functools.partial(kernel.rotate_qk_, rotary_dims=r, layout=layout,
                                         **_angles(angles, positions, inv_freq))
            q_out, k_out = rotate_in_place(q, k, rotation)
        else:
            q_out, k_out = (apply_partial_rope(t, cos, sin, r, layout) for t in (q, k))
        grads = torch.autograd.grad((q_out, k_out), (x, wq, wk), tuple(u.clone() for u in upstream))
        results.append((q_out.detach(), k_out.detach(), *grads))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["table", "none"])
def test_rotary_embedding_dispatches_to_the_kernel(kernel, cache, monkeypatch):
    """`RotaryEmbedding` hands q and k to the Triton kernel (angles by position, table grown to the
    largest position) and gives the reference's values and gradients; a negative position, which
    the table cannot hold, takes the reference instead of reaching the kernel."""
    import ropelab.rope.embedding as rope_module
    from ropelab.config import RopeConfig
    from ropelab.rope import RotaryEmbedding

    calls = []
    rotate_qk_ = kernel.rotate_qk_
    monkeypatch.setattr(rope_module, "triton_kernels", lambda: kernel)
    monkeypatch.setattr(kernel, "rotate_qk_", lambda *a, **kw: calls.append(kw) or rotate_qk_(*a, **kw))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, C, generator=g).to(DEVICE).requires_grad_()
    wq = (torch.randn(H * D, C, generator=g) / C**0.5).to(DEVICE).requires_grad_()
    wk = (torch.randn(K * D, C, generator=g) / C**0.5).to(DEVICE).requires_grad_()
    upstream = torch.randn(B, H, T, D, generator=g).to(DEVICE), torch.randn(B, K, T, D, generator=g).to(DEVICE)
    rope = RotaryEmbedding(RopeConfig(fraction=0.25, theta=500.0, cache=cache), D)
    for positions, reaches_kernel in ((torch.randint(0, 4000, (B, T), generator=g), True),
                                      (torch.arange(T).repeat(B, 1) - 1, cache == "none")):
        positions = positions.to(DEVICE)
        calls.clear()
        results = []
        for fast in (True, False):
            q = F.linear(x, wq).view(B, T, H, D).transpose(1, 2)
            k = F.linear(x, wk).view(B, T, K, D).transpose(1, 2)
            rope.inplace = None if fast else False
            q_out, k_out = rope(q, k, positions)
            grads = torch.autograd.grad((q_out, k_out), (x, wq, wk), tuple(u.clone() for u in upstream))
            results.append((q_out.detach(), k_out.detach(), *grads))
        for ours, theirs in zip(*results):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert len(calls) == (2 if reaches_kernel else 0)  # forward, then backward (inverse)
        if reaches_kernel and cache == "table":
            assert calls[0]["cos_table"].shape[0] == int(positions.max()) + 1
