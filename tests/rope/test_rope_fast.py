"""The in-place partial RoPE fast path (`PartialRotary`, picked by `RotaryEmbedding.forward`) against
the out-of-place reference `apply_partial_rope`: values, gradients, pass-through channels, fallbacks.
The CPU rotation runs on the C kernel (`rope.cpu_kernel`) or, with it switched off, the torch path: both are
tested (fixture `cpu_kernel`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ropelab.config import ModelConfig, RopeConfig
from ropelab.model import Transformer
from ropelab.rope import cpu_kernel as rope_cpu
from ropelab.rope import RotaryEmbedding, apply_partial_rope, partial_rotary, rope_angles, rotate, rotate_

B, T, C, H, K, D = 2, 13, 24, 4, 2, 32
FRACTIONS = {"nope": {"fraction": 0.0}, "2dims": {"rotary_dims": 2}, "0.1": {"fraction": 0.1},
             "0.25": {"fraction": 0.25}, "0.5": {"fraction": 0.5}, "1.0": {"fraction": 1.0}}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}


@pytest.fixture(params=["c", "torch"])
def cpu_kernel(request, monkeypatch):
    """Run the test on the C kernel (skipped where it cannot be built) or on the torch path."""
    if request.param == "torch":
        monkeypatch.setattr(rope_cpu, "library", lambda: None)
    elif not rope_cpu.available():
        pytest.skip("no C compiler: the CPU kernel is unavailable")
    return request.param


def _rope(spec: str, layout: str, cache: str) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(theta=500.0, layout=layout, cache=cache, **FRACTIONS[spec]), D)


def _setup(dtype, seed=0):
    """Leaves: input x, projection weights, position ids, upstream gradients for q and k."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(dtype).requires_grad_()
    wq = (torch.randn(H * D, C, generator=g) / C**0.5).to(dtype).requires_grad_()
    wk = (torch.randn(K * D, C, generator=g) / C**0.5).to(dtype).requires_grad_()
    positions = torch.randint(0, 4000, (B, T), generator=g)
    grads = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, K, T, D, generator=g).to(dtype)
    return x, wq, wk, positions, grads


def _project(x, wq, wk, view: bool):
    """q (B, H, T, D), k (B, K, T, D) as `Attention` makes them: transposed views of the projections,
    or (view=False) fresh contiguous tensors."""
    q = F.linear(x, wq).view(B, T, H, D).transpose(1, 2)
    k = F.linear(x, wk).view(B, T, K, D).transpose(1, 2)
    return (q, k) if view else (q.contiguous(), k.contiguous())


def _nodes(tensor: torch.Tensor) -> set[str]:
    """The names of the autograd nodes on tensor's graph."""
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def _uses_fast_path(tensor: torch.Tensor) -> bool:
    """Whether a PartialRotary node lies on tensor's autograd graph."""
    return any("PartialRotary" in name for name in _nodes(tensor))


def _run(spec, layout, cache, dtype, view, fast: bool):
    """Rotated q, k and the gradients wrt pre-RoPE q, k (non-view case), x, wq, wk."""
    x, wq, wk, positions, (gq, gk) = _setup(dtype)
    rope = _rope(spec, layout, cache)
    q, k = _project(x, wq, wk, view)
    q_before, k_before = q.detach().clone(), k.detach().clone()
    edges = [] if view else [torch.autograd.graph.get_gradient_edge(t) for t in (q, k)]
    if fast:
        q_out, k_out = rope(q, k, positions)
    else:
        cos, sin = rope.cos_sin(positions)
        q_out = apply_partial_rope(q, cos, sin, rope.rotary_dims, layout)
        k_out = apply_partial_rope(k, cos, sin, rope.rotary_dims, layout)
    assert fast == _uses_fast_path(q_out) or rope.rotary_dims == 0
    inputs = [*edges, x, wq, wk]
    grads = torch.autograd.grad((q_out, k_out), inputs, (gq.clone(), gk.clone()))
    return rope.rotary_dims, (q_before, k_before), (q_out.detach(), k_out.detach()), grads, (gq, gk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("view", [True, False], ids=["view", "contiguous"])
@pytest.mark.parametrize("cache", ["table", "none"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("spec", list(FRACTIONS))
def test_fast_path_matches_reference(spec, layout, cache, view, dtype, cpu_kernel):
    r, before, fast_out, fast_grads, (gq, gk) = _run(spec, layout, cache, dtype, view, fast=True)
    _, _, ref_out, ref_grads, _ = _run(spec, layout, cache, dtype, view, fast=False)
    for ours, theirs in zip(fast_out + fast_grads, ref_out + ref_grads):
        torch.testing.assert_close(ours, theirs, **TOL[dtype])
    # Pass-through channels: bit-identical values, and their gradients are the upstream ones, untouched.
    for out, original in zip(fast_out, before):
        assert torch.equal(out[..., r:], original[..., r:])
    if not view:
        grad_q, grad_k = fast_grads[:2]
        assert torch.equal(grad_q[..., r:], gq[..., r:]) and torch.equal(grad_k[..., r:], gk[..., r:])


@pytest.mark.parametrize("cache", ["table", "none"])
def test_fraction_zero_does_nothing(cache):
    x, wq, wk, positions, _ = _setup(torch.float32)
    rope = _rope("nope", "half", cache)
    q, k = _project(x, wq, wk, view=True)
    versions = q._version, k._version
    q_out, k_out = rope(q, k, positions)
    assert q_out is q and k_out is k and (q._version, k._version) == versions
    assert rope.cache_bytes() == 0


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotates_only_the_rotary_channels_in_place(layout):
    """The fast path writes the rotation into the projection output's own memory."""
    x, wq, wk, positions, _ = _setup(torch.float32)
    rope = _rope("0.25", layout, "table")
    q, k = _project(x, wq, wk, view=True)
    pointer, before = q.untyped_storage().data_ptr(), q.detach().clone()
    q_out, _ = rope(q, k, positions)
    assert q_out.untyped_storage().data_ptr() == pointer and q_out.shape == q.shape and q_out.stride() == q.stride()
    assert torch.equal(q.detach(), q_out.detach())  # q itself now holds the rotated values
    assert not torch.equal(q_out[..., : rope.rotary_dims], before[..., : rope.rotary_dims])


def _reference(rope, q, k, positions):
    cos, sin = rope.cos_sin(positions)
    return (apply_partial_rope(q, cos, sin, rope.rotary_dims, rope.layout),
            apply_partial_rope(k, cos, sin, rope.rotary_dims, rope.layout))


def test_falls_back_where_in_place_is_unsafe():
    x, wq, wk, positions, _ = _setup(torch.float32)
    rope = _rope("0.5", "half", "table")
    cases = {
        "leaves requiring grad": (torch.randn(B, H, T, D, requires_grad=True), torch.randn(B, K, T, D, requires_grad=True)),
        "views of leaves": (torch.randn(B, T, H * D, requires_grad=True).view(B, T, H, D).transpose(1, 2),
                            torch.randn(B, T, K * D, requires_grad=True).view(B, T, K, D).transpose(1, 2)),
        "no grad needed": (torch.randn(B, H, T, D), torch.randn(B, K, T, D)),
        "multi-output views": F.linear(x, torch.cat((wq, wk))).split([H * D, K * D], dim=-1),
    }
    shared = torch.randn(B, H, T, D)
    cases["q and k aliasing"] = (shared, shared[:, :K])
    for name, (q, k) in cases.items():
        if name == "multi-output views":
            q, k = q.view(B, T, H, D).transpose(1, 2), k.view(B, T, K, D).transpose(1, 2)
        before = q.detach().clone(), k.detach().clone()
        q_out, k_out = rope(q, k, positions)
        assert not _uses_fast_path(q_out), name
        assert torch.equal(q.detach(), before[0]) and torch.equal(k.detach(), before[1]), name  # inputs untouched
        ref_q, ref_k = _reference(rope, before[0], before[1], positions)
        assert torch.equal(q_out.detach(), ref_q) and torch.equal(k_out.detach(), ref_k), name


def test_inplace_false_always_uses_the_reference():
    x, wq, wk, positions, _ = _setup(torch.float32)
    rope = _rope("0.25", "half", "table")
    rope.inplace = False
    q, k = _project(x, wq, wk, view=True)
    assert not _uses_fast_path(rope(q, k, positions)[0])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forced_inplace_without_grad(layout, dtype, cpu_kernel):
    """inplace=True: inference rotates in place too, with the reference's values."""
    x, wq, wk, positions, _ = _setup(dtype)
    rope = _rope("0.25", layout, "none")
    with torch.no_grad():
        q, k = _project(x, wq, wk, view=True)
        ref_q, ref_k = _reference(rope, q, k, positions)
        rope.inplace = True
        q_out, k_out = rope(q, k, positions)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_out, ref_k, **TOL[dtype])
    assert torch.equal(q_out[..., rope.rotary_dims:], ref_q[..., rope.rotary_dims:])


def test_backward_copies_an_overlapping_gradient(cpu_kernel):
    """loss = q.sum() hands backward an expanded (stride 0) gradient: it must not be written into."""
    x, wq, wk, positions, _ = _setup(torch.float32)
    grads = []
    for fast in (True, False):
        rope = _rope("0.5", "half", "table")
        rope.inplace = None if fast else False
        q, k = _project(x, wq, wk, view=False)
        q_out, k_out = rope(q, k, positions)
        grads.append(torch.autograd.grad(q_out.sum() + 2 * k_out.sum(), (wq, wk)))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotate_inverse_undoes_rotate(layout):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, T, D, generator=g)
    cos, sin = (t.unsqueeze(1) for t in rope_angles(torch.randint(0, 9999, (B, T), generator=g), torch.rand(6)))
    y = rotate_(rotate_(x.clone(), cos, sin, 12, layout), cos, sin, 12, layout, inverse=True)
    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[..., 12:], x[..., 12:])


@pytest.mark.parametrize("angles", ["per token", "table rows", "table rows, one row of positions"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dims", [2, 6, 10, 16, 40, 64])
def test_cpu_kernel_gives_the_reference_bits(rotary_dims, layout, dtype, angles):
    """rope_cpu on q and k together (a transposed view and a contiguous tensor, angles broadcast over
    heads) equals `rotate` bit for bit, forward and inverse; the other channels are not touched.
    The angles are cos/sin per token, or rows of a table picked by position ids (B, T) or (1, T)
    inside the kernel. 16 and 64 channels use the kernel's unrolled loops, 10 and 40 its general loop."""
    if not rope_cpu.available():
        pytest.skip("no C compiler: the CPU kernel is unavailable")
    g = torch.Generator().manual_seed(rotary_dims)
    q = torch.randn(2, 9, 3, 64, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(2, 1, 9, 64, generator=g).to(dtype)
    positions = torch.randint(0, 50, (1 if "one row" in angles else 2, 9), generator=g)
    cos_table, sin_table = rope_angles(torch.arange(50), torch.rand(rotary_dims // 2, generator=g))
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    source = {} if angles == "per token" else {"positions": positions}
    for inverse in (False, True):
        q_out, k_out = q.clone().transpose(1, 2).contiguous().transpose(1, 2), k.clone()
        if source:
            assert rope_cpu.rotate_((q_out, k_out), cos_table, sin_table, rotary_dims, layout, inverse, **source)
        else:
            assert rope_cpu.rotate_((q_out, k_out), cos, sin, rotary_dims, layout, inverse)
        for out, x in ((q_out, q), (k_out, k)):
            assert torch.equal(out[..., :rotary_dims], rotate(x[..., :rotary_dims], cos, -sin if inverse else sin, layout))
            assert torch.equal(out[..., rotary_dims:], x[..., rotary_dims:])


def test_cpu_kernel_declines_what_it_cannot_rotate():
    """Unsupported inputs return False and are left as they were (the caller uses the torch path)."""
    cos, sin = (t.unsqueeze(1) for t in rope_angles(torch.arange(T).expand(B, T), torch.rand(4)))
    x = torch.randn(B, H, T, D)
    cases = {
        "float64": ((x.double(),), cos, sin, 8),
        "3-D": ((x[0],), cos[0], sin[0], 8),
        "channels not contiguous": ((x.transpose(2, 3)[..., :T, :],), cos, sin, 8),
        "more rotary dims than channels": ((x[..., :6],), cos, sin, 8),
        "cos/sin of the wrong width": ((x,), cos, sin, 6),
        "cos/sin that do not broadcast": ((x,), cos[:, :, :5], sin[:, :, :5], 8),
    }
    table = rope_angles(torch.arange(T), torch.rand(4))
    positions = torch.arange(T).expand(B, T)
    by_position = {
        "int32 positions": ((x,), *table, 8, positions.int()),
        "positions that do not broadcast": ((x,), *table, 8, positions[:, :5]),
        "positions of a growing batch": ((x[:1],), *table, 8, positions),
        "3-D positions": ((x,), *table, 8, positions[None]),
    }
    for name, (tensors, c, s, dims, *source) in {**cases, **by_position}.items():
        before = [t.clone() for t in tensors]
        assert not rope_cpu.rotate_(tensors, c, s, dims, "half", positions=source[0] if source else None), name
        assert all(torch.equal(t, b) for t, b in zip(tensors, before)), name


def test_position_range_is_checked_once_per_position_tensor_and_again_after_it_changes(monkeypatch, cpu_kernel):
    """The in-kernel table lookup must never read past the table: the range check is reused only
    for the same, unmodified position tensor; a position edited in place grows the table again."""
    x, wq, wk, _, _ = _setup(torch.float32)
    rope = _rope("0.25", "half", "table")
    positions = torch.arange(T).repeat(B, 1)
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(t) or aminmax(t))
    for _ in range(2):  # two layers sharing the module and the positions
        q, k = _project(x, wq, wk, view=True)
        rope(q, k, positions)
    positions[1, -1] = 5000  # beyond the table built so far
    q, k = _project(x, wq, wk, view=True)
    q_out, k_out = rope(q, k, positions)
    ref_q, ref_k = _reference(rope, *_project(x, wq, wk, view=True), positions)
    torch.testing.assert_close(q_out, ref_q)
    torch.testing.assert_close(k_out, ref_k)
    if cpu_kernel == "c":  # the torch path gathers cos/sin instead (its indexing checks the range)
        assert len(calls) == 2 and rope.cos_table.shape[0] == 5001


def test_positions_edited_between_forward_and_backward(cpu_kernel):
    """The kernel's backward looks the positions up again, so editing them in place after the
    forward is refused (they could lie past the table); the torch path holds its own cos/sin and
    gives the gradients of the positions the forward used."""
    x, wq, wk, positions, (gq, gk) = _setup(torch.float32)
    rope = _rope("0.25", "half", "table")
    q, k = _project(x, wq, wk, view=True)
    q_out, k_out = rope(q, k, positions)
    expected = _run("0.25", "half", "table", torch.float32, view=True, fast=False)[3]
    positions.add_(10_000)
    if cpu_kernel == "c":
        with pytest.raises(RuntimeError, match="modified in place between the forward pass"):
            torch.autograd.grad((q_out, k_out), (x, wq, wk), (gq, gk))
    else:
        for ours, theirs in zip(torch.autograd.grad((q_out, k_out), (x, wq, wk), (gq, gk)), expected):
            torch.testing.assert_close(ours, theirs)


def test_cpu_kernel_off_leaves_the_torch_path(monkeypatch):
    """Switched off or unbuildable, the kernel declines (tests/test_native.py builds and switches off
    every loop): the rotation then runs its torch path."""
    monkeypatch.setattr(rope_cpu, "library", lambda: None)
    assert not rope_cpu.available()
    x = torch.randn(1, 2, 3, 8)
    cos, sin = (t.unsqueeze(1) for t in rope_angles(torch.arange(3)[None], torch.rand(2)))
    assert not rope_cpu.rotate_((x,), cos, sin, 4, "half")


def test_partial_rotary_declines_a_growing_broadcast():
    """cos/sin with a larger batch than q cannot be written into q: the caller falls back."""
    x, wq, wk, _, _ = _setup(torch.float32)
    q, k = _project(x, wq, wk, view=False)
    cos, sin = (t.unsqueeze(1) for t in rope_angles(torch.arange(T).expand(2 * B, T), torch.rand(4)))
    assert partial_rotary(q, k, cos, sin, 8) is None


# ------------------------------------------------------------------ whole model


TINY = dict(vocab_size=64, n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96, max_seq_len=512)


def _model_loss_and_grads(config: ModelConfig, inplace, autocast: bool):
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(config))
    for rope in model.ropes:
        rope.inplace = inplace
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, loss = model(idx, idx)
    assert _uses_fast_path(loss) == (inplace is None)  # the model's q/k (projection views) take the fast path
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 1.0])
def test_model_gradients_match_reference(fraction, layout, qk_norm):
    config = ModelConfig(rope=RopeConfig(fraction=fraction, layout=layout), qk_norm=qk_norm, **TINY)
    loss_fast, grads_fast = _model_loss_and_grads(config, None, autocast=False)
    loss_ref, grads_ref = _model_loss_and_grads(config, False, autocast=False)
    torch.testing.assert_close(loss_fast, loss_ref, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(grads_fast, grads_ref):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_model_gradients_match_reference_under_bf16_autocast(layout):
    config = ModelConfig(rope=RopeConfig(fraction=0.25, layout=layout), **TINY)
    loss_fast, grads_fast = _model_loss_and_grads(config, None, autocast=True)
    loss_ref, grads_ref = _model_loss_and_grads(config, False, autocast=True)
    torch.testing.assert_close(loss_fast, loss_ref, rtol=1e-2, atol=1e-2)
    for ours, theirs in zip(grads_fast, grads_ref):
        torch.testing.assert_close(ours, theirs, rtol=5e-2, atol=5e-3)


def test_model_compiles_without_graph_breaks():
    """Under torch.compile RoPE takes the traceable reference (cos/sin from the positions, not the
    table): the model is one graph (fullgraph=True fails on any break), with the eager loss and
    gradients. Dynamo with a pass-through backend: the tracing is what is tested, not Inductor."""
    config = ModelConfig(rope=RopeConfig(fraction=0.25, cache="table"), **TINY)
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    model = Transformer(config)
    eager_loss = model(idx, idx)[1]
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    graphs = []
    compiled = torch.compile(model, backend=lambda gm, inputs: graphs.append(gm) or gm.forward, fullgraph=True)
    compiled_loss = compiled(idx, idx)[1]
    compiled_grads = torch.autograd.grad(compiled_loss, list(model.parameters()))
    assert len(graphs) == 1
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


VIEWS = {  # (B, T, H * D) projection -> (B, H, T, D) q of the shape rope takes, as a view of it
    "transpose": lambda p: p.view(B, T, H, D).transpose(1, 2),
    "permute": lambda p: p.view(T, B, H, D).permute(1, 2, 0, 3),  # tokens outermost in memory
    "narrowed": lambda p: p.view(B, T, 2 * H, D // 2)[:, :, :H].transpose(1, 2).contiguous().view(B, H, T, D // 2),
    "strided slice": lambda p: p.view(B, T, H, D)[:, :, :, :D // 2].transpose(1, 2),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_rotated_views_are_rebuilt_by_view_ops_where_they_fill_their_base(view, cpu_kernel):
    """q and k come back as views of the rotated projections with their own strides: by a view and a permute
    where they fill it (backward: at most one copy), by replaying their view ops otherwise (as_strided); the
    values and gradients are the reference's either way."""
    x, wq, wk, positions, _ = _setup(torch.float32)
    wk = torch.randn(H * D, C, generator=torch.Generator().manual_seed(1)).requires_grad_()  # k with q's shape
    rope = RotaryEmbedding(RopeConfig(theta=500.0, fraction=0.5), D if view in ("transpose", "permute") else D // 2)
    results = []
    for fast in (True, False):
        q, k = VIEWS[view](F.linear(x, wq)), VIEWS[view](F.linear(x, wk))
        if fast:
            q_out, k_out = rope(q, k, positions)
        else:
            q_out, k_out = _reference(rope, q, k, positions)
        g = torch.Generator().manual_seed(2)
        upstream = torch.randn(q_out.shape, generator=g), torch.randn(k_out.shape, generator=g)
        results.append([q_out.detach(), k_out.detach(), *torch.autograd.grad((q_out, k_out), (x, wq, wk), upstream)])
        if fast and view in ("transpose", "permute"):
            assert q_out.stride() == q.stride() and _uses_fast_path(q_out)
            assert "AsStridedBackward0" not in _nodes(q_out) | _nodes(k_out)
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
