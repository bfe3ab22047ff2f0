"""kd_loss against direct fp32 computations: values, gradients, chunking, top-k, padding columns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from ropelab.train.loss import TeacherHidden, TeacherTopK, kd_loss, teacher_topk

TOL = 1e-5


def _inputs(seed=0, B=2, T=24, C=16, V=50, Vt=None, Ct=12, ignore=(0, 5, 23)):
    """Student hidden/head, teacher hidden/head and labels with some ignored positions."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T, C, generator=g)
    W = torch.randn(V, C, generator=g) * 0.5
    ht = torch.randn(B, T, Ct, generator=g)
    Wt = torch.randn(Vt or V, Ct, generator=g) * 0.7
    labels = torch.randint(0, Vt or V, (B, T), generator=g)
    labels[0, list(ignore)] = -100
    return hs, W, ht, Wt, labels


def _direct(hs, W, labels, zt, T, alpha, top_k=None, z_loss=0.0):
    """The textbook computation on full (B*T, V) fp32 logits."""
    keep = labels != -100
    zs, lab, zt = (hs @ W.T)[keep], labels[keep], zt[keep]
    ce = F.cross_entropy(zs, lab)
    logq = F.log_softmax(zs / T, dim=-1)[:, : zt.shape[-1]]
    if top_k is None:
        kl = F.kl_div(logq, F.log_softmax(zt / T, dim=-1), log_target=True, reduction="none").sum(-1)
    else:
        kl = _topk_by_hand(zs, zt, T, top_k)
    kd = T * T * kl.mean()
    z = zs.logsumexp(-1).square().mean()
    return alpha * kd + (1 - alpha) * ce + z_loss * z, kd, ce


def _topk_by_hand(zs, zt, T, k):
    """KL over the teacher's top-k ids plus one rest bucket, from full softmaxes (float64)."""
    p, q = F.softmax(zt.double() / T, -1), F.softmax(zs.double() / T, -1)
    ids = p.topk(k, -1).indices
    p_k, q_k = p.gather(1, ids), q.gather(1, ids)
    p_rest, q_rest = 1 - p_k.sum(-1), 1 - q_k.sum(-1)
    rest = torch.where(p_rest > 0, p_rest * torch.log(p_rest / q_rest), 0.0)
    return ((p_k * torch.log(p_k / q_k)).sum(-1) + rest).float()


@pytest.mark.parametrize("T,alpha,chunk", [(1.0, 1.0, 7), (2.0, 0.5, 16), (0.7, 0.0, 48), (4.0, 0.25, 4096), (1.0, 0.5, 45)])
def test_full_vocab_matches_direct_values_and_gradients(T, alpha, chunk):
    hs, W, ht, Wt, labels = _inputs()
    hs1, W1 = hs.clone().requires_grad_(), W.clone().requires_grad_()
    out = kd_loss(hs1, W1, labels, TeacherHidden(ht, Wt), T, alpha, None, chunk, z_loss=1e-2)
    out.loss.backward()

    hs2, W2 = hs.clone().requires_grad_(), W.clone().requires_grad_()
    loss, kd, ce = _direct(hs2, W2, labels, ht @ Wt.T, T, alpha, z_loss=1e-2)
    loss.backward()
    assert out.loss.item() == pytest.approx(loss.item(), rel=TOL, abs=TOL)
    assert out.kd.item() == pytest.approx(kd.item(), rel=TOL, abs=TOL)
    assert out.ce.item() == pytest.approx(ce.item(), rel=TOL, abs=TOL)
    torch.testing.assert_close(hs1.grad, hs2.grad, rtol=TOL, atol=TOL)
    torch.testing.assert_close(W1.grad, W2.grad, rtol=TOL, atol=TOL)
    assert hs1.grad[0, 5].abs().max() == 0  # an ignored position gets no gradient


@pytest.mark.parametrize("k,chunk", [(1, 5), (3, 16), (10, 4096)])
def test_top_k_matches_hand_formula_with_gradients(k, chunk):
    T, alpha = 2.0, 0.75
    hs, W, ht, Wt, labels = _inputs(seed=1)
    hs1, W1 = hs.clone().requires_grad_(), W.clone().requires_grad_()
    out = kd_loss(hs1, W1, labels, TeacherHidden(ht, Wt), T, alpha, k, chunk)
    out.loss.backward()
    hs2, W2 = hs.clone().requires_grad_(), W.clone().requires_grad_()
    loss, kd, _ = _direct(hs2, W2, labels, ht @ Wt.T, T, alpha, top_k=k)
    loss.backward()
    assert out.kd.item() == pytest.approx(kd.item(), rel=TOL, abs=TOL)
    assert out.loss.item() == pytest.approx(loss.item(), rel=TOL, abs=TOL)
    torch.testing.assert_close(hs1.grad, hs2.grad, rtol=1e-4, atol=TOL)
    torch.testing.assert_close(W1.grad, W2.grad, rtol=1e-4, atol=TOL)


def test_top_k_equal_to_vocab_is_the_full_kl():
    hs, W, ht, Wt, labels = _inputs(seed=2, V=300)
    full = kd_loss(hs, W, labels, TeacherHidden(ht, Wt), 1.5, 1.0, None, 19)
    all_k = kd_loss(hs, W, labels, TeacherHidden(ht, Wt), 1.5, 1.0, 300, 19)
    assert full.kd.item() > 0.1
    assert all_k.kd.item() == pytest.approx(full.kd.item(), rel=TOL, abs=TOL)


def test_stored_top_k_targets_give_the_live_loss():
    hs, W, ht, Wt, labels = _inputs(seed=3)
    live = kd_loss(hs, W, labels, TeacherHidden(ht, Wt), 2.0, 1.0, 4, 9)
    logp, ids = teacher_topk(ht @ Wt.T, 2.0, 6)  # stored with a larger k, read with k = 4
    stored = kd_loss(hs, W, labels, TeacherTopK(logp, ids, 2.0), 2.0, 1.0, 4, 9)
    assert stored.kd.item() == pytest.approx(live.kd.item(), rel=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        kd_loss(hs, W, labels, TeacherTopK(logp, ids, 2.0), 1.0)


def test_teacher_with_fewer_columns_gives_padding_columns_zero_probability():
    """Student rows beyond the teacher's vocabulary (padding) stay in the student's softmax."""
    hs, W, ht, Wt, labels = _inputs(seed=4, V=64, Vt=50)
    W1, W2 = W.clone().requires_grad_(), W.clone().requires_grad_()
    out = kd_loss(hs, W1, labels, TeacherHidden(ht, Wt), 1.0, 1.0, None, 10)
    _, kd, _ = _direct(hs, W2, labels, ht @ Wt.T, 1.0, 1.0)
    out.loss.backward()
    kd.backward()
    assert out.kd.item() == pytest.approx(kd.item(), rel=TOL)
    torch.testing.assert_close(W1.grad, W2.grad, rtol=TOL, atol=TOL)
    assert (W1.grad[50:] @ hs.flatten(0, 1).T).sum() > 0  # pushing the padding logits down lowers the loss
    # The padding columns carry student mass, so the KL is larger than over the first 50 alone.
    keep = labels != -100
    zs = (hs @ W.T)[keep]
    first = F.kl_div(F.log_softmax(zs[:, :50], -1), F.log_softmax((ht @ Wt.T)[keep], -1), log_target=True,
                     reduction="none").sum(-1).mean()
    assert out.kd.item() > first.item()


@pytest.mark.parametrize("k", [None, 4])
def test_masked_teacher_ids_have_zero_probability_not_nan(k):
    """Teacher logits of -inf (ids a teacher masks; fp16 log-probs that underflow) mean p = 0."""
    hs, W, _, _, labels = _inputs(seed=7, V=20)
    zt, eye = torch.randn(2, 24, 20, generator=torch.Generator().manual_seed(8)), torch.eye(20)
    mask = torch.zeros(20)
    mask[3] = float("-inf")  # a head bias of -inf: the teacher's logit of id 3 is -inf
    hs1, hs2 = hs.clone().requires_grad_(), hs.clone().requires_grad_()
    masked = kd_loss(hs1, W, labels, TeacherHidden(zt, eye, mask), 1.0, 1.0, k, 5)
    finite = kd_loss(hs2, W, labels, TeacherHidden(zt, eye, mask.clamp(min=-1e4)), 1.0, 1.0, k, 5)
    masked.loss.backward()
    finite.loss.backward()
    assert masked.kd.isfinite() and masked.kd.item() == pytest.approx(finite.kd.item(), rel=TOL)
    torch.testing.assert_close(hs1.grad, hs2.grad, rtol=TOL, atol=TOL)
    logp, ids = teacher_topk(zt + mask, 1.0, 20)  # stored targets holding -inf
    assert kd_loss(hs, W, labels, TeacherTopK(logp, ids, 1.0), 1.0, 1.0).kd.isfinite()


def test_bf16_autocast_stays_close_to_fp32():
    """Under autocast the logits matmuls run in bf16; the softmax arithmetic stays fp32."""
    hs, W, ht, Wt, labels = _inputs(seed=9)
    W1, W2 = W.clone().requires_grad_(), W.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = kd_loss(hs, W1, labels, TeacherHidden(ht, Wt), 2.0, 0.5, None, 16)
    full = kd_loss(hs, W2, labels, TeacherHidden(ht, Wt), 2.0, 0.5, None, 16)
    low.loss.backward()
    full.loss.backward()
    assert low.loss.dtype == torch.float32 and W1.grad.dtype == torch.float32
    assert low.loss.item() == pytest.approx(full.loss.item(), rel=2e-2)
    assert (W1.grad - W2.grad).norm() <= 0.05 * W2.grad.norm()


def _autocast_loss(device, per_product: bool, monkeypatch, teacher: bool, top_k=None):
    """kd_loss under bf16 autocast on `device`: with its own casts (the head cast once), or `per_product`,
    with autocast casting the operands of every product itself (what the loss did before it cast them:
    forced here by making the loss see a torch-function override); the loss, its parts and both gradients,
    and the head-sized casts made on the way."""
    import ropelab.train.loss as loss_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from ropelab.train import cross_entropy_kernel

    # the torch path on both sides (the CPU loop, which only the own casts reach, is within one rounding
    # of it: tests/train/test_cross_entropy_kernel.py)
    monkeypatch.setattr(cross_entropy_kernel, "library", lambda: None)
    if per_product:
        monkeypatch.setattr(loss_module, "has_torch_function", lambda args: True)
    hs, W, ht, Wt, labels = (t.to(device) for t in _inputs(seed=11, T=40, V=300, C=32))
    hs.requires_grad_()
    W.requires_grad_()
    head_casts = []

    class CountCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16
                    and out.shape in (W.shape, W.t().shape)):
                head_casts.append(tuple(out.shape))
            return out

    with torch.autocast(device, dtype=torch.bfloat16), CountCasts():
        out = kd_loss(hs, W, labels, TeacherHidden(ht, Wt) if teacher else None, 2.0, 0.5, top_k, 16)
    out.loss.backward()
    monkeypatch.undo()
    return [out.loss, out.kd, out.ce, hs.grad, W.grad], head_casts


LOSS_CASES = [(False, None), (True, None), (True, 8)]  # (teacher, top_k)


def _loss_under_own_casts_equals_per_product_casts(device, monkeypatch, teacher, top_k):
    own, own_casts = _autocast_loss(device, False, monkeypatch, teacher, top_k)
    plain, plain_casts = _autocast_loss(device, True, monkeypatch, teacher, top_k)
    for a, b in zip(own, plain, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # 77 kept tokens, 5 chunks: the loss casts the head once; autocast casts it once for the logits (then
    # cached), and its transpose, a view it never caches, again for every chunk's hidden-state gradient
    assert own_casts == [(300, 32)]
    if device == "cpu":
        assert plain_casts == [(300, 32)] + [(32, 300)] * 5
    else:  # not run here (no GPU in CI): only that autocast casts more often than the loss does
        assert len(plain_casts) > 1


@pytest.mark.parametrize("teacher,top_k", LOSS_CASES)
def test_bf16_autocast_head_cast_once_gives_autocasts_own_values_bit_for_bit(teacher, top_k, monkeypatch):
    _loss_under_own_casts_equals_per_product_casts("cpu", monkeypatch, teacher, top_k)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("teacher,top_k", LOSS_CASES)
def test_bf16_cuda_autocast_head_cast_once_gives_autocasts_own_values_bit_for_bit(teacher, top_k, monkeypatch):
    _loss_under_own_casts_equals_per_product_casts("cuda", monkeypatch, teacher, top_k)


def test_bf16_gemm_mode_keeps_routing_the_heads_products():
    """Under precision.Bf16GemmInFp32 (the CPU policy without bf16 units) the loss casts nothing itself and
    hands every product of every chunk to the mode, which runs it as an fp32 GEMM on bf16-rounded operands."""
    import torch.nn.functional as F_

    from ropelab.precision import Bf16GemmInFp32

    linears = []

    class CountingMode(Bf16GemmInFp32):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F_.linear:
                linears.append(tuple(args[1].shape))
            return super().__torch_function__(func, types, args, kwargs)

    hs, W, _, _, labels = _inputs(seed=12, T=40, V=300, C=32)
    hs.requires_grad_()
    W.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), CountingMode():
        out = kd_loss(hs, W, labels, None, chunk_tokens=16)
    out.loss.backward()
    # for each of the 5 chunks of 77 kept tokens (16, 16, 16, 16, 13): the logits (head), the hidden states'
    # gradient (head^T), the head's gradient (the chunk's hidden states^T)
    assert sorted(set(linears)) == [(32, 13), (32, 16), (32, 300), (300, 32)] and len(linears) == 15
    assert W.grad.dtype == torch.float32 and W.grad.isfinite().all()


def test_cross_entropy_only_and_all_ignored():
    hs, W, _, _, labels = _inputs(seed=5)
    out = kd_loss(hs, W, labels, None, chunk_tokens=11)
    keep = labels != -100
    assert out.loss.item() == pytest.approx(F.cross_entropy((hs @ W.T)[keep], labels[keep]).item(), rel=TOL)
    assert out.kd.item() == 0
    none = kd_loss(hs.requires_grad_(), W, torch.full_like(labels, -100))
    none.loss.backward()
    assert none.loss.item() == 0 and hs.grad.abs().max() == 0


def test_tied_head_module_and_bad_arguments():
    hs, W, ht, Wt, labels = _inputs(seed=6)
    head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(W)
    out = kd_loss(hs, head, labels, TeacherHidden(ht, Wt), 1.0, 0.5, None, 13)
    out.loss.backward()
    hs2, W2 = hs.clone(), W.clone().requires_grad_()
    _direct(hs2, W2, labels, ht @ Wt.T, 1.0, 0.5)[0].backward()
    torch.testing.assert_close(head.weight.grad, W2.grad, rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="top_k"):
        kd_loss(hs, W, labels, TeacherHidden(ht, Wt), top_k=51)
    with pytest.raises(ValueError, match="temperature"):
        kd_loss(hs, W, labels, TeacherHidden(ht, Wt), temperature=0.0)


def _kd_of_logits(zs, zt, T, k):
    """kd_loss on given student and teacher logits (n, V): hidden states are the logits, heads the identity."""
    eye = torch.eye(zs.shape[1])
    labels = torch.zeros(1, zs.shape[0], dtype=torch.long)
    return kd_loss(zs[None], eye, labels, TeacherHidden(zt[None], eye), T, 1.0, k, 3).kd.item()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), V=st.integers(2, 40), T=st.floats(0.25, 8.0), k=st.integers(1, 40),
       scale=st.floats(0.0, 20.0))
def test_kl_properties(seed, V, T, k, scale):
    """KL >= 0; KL = 0 for identical logits; merging outcomes: 0 <= KL_k <= KL."""
    g = torch.Generator().manual_seed(seed)
    zs, zt = torch.randn(5, V, generator=g) * scale, torch.randn(5, V, generator=g) * scale
    k = min(k, V)
    full, sparse = _kd_of_logits(zs, zt, T, None), _kd_of_logits(zs, zt, T, k)
    # The loss is T^2 x KL, so fp32 rounding in KL (~1e-7 when p and q agree) is scaled by T^2 too.
    tol = max(1.0, T * T)
    assert full >= -1e-6 * tol and sparse >= -1e-5 * tol
    assert sparse <= full + 1e-4 * (1 + full)
    assert abs(_kd_of_logits(zt, zt, T, None)) <= 1e-5 * tol and abs(_kd_of_logits(zt, zt, T, k)) <= 1e-4 * tol


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), T=st.floats(0.5, 4.0), k=st.one_of(st.none(), st.integers(1, 30)))
def test_student_equal_to_teacher_has_zero_kd(seed, T, k):
    g = torch.Generator().manual_seed(seed)
    h, W = torch.randn(1, 9, 8, generator=g), torch.randn(30, 8, generator=g)
    labels = torch.randint(0, 30, (1, 9), generator=g)
    out = kd_loss(h, W, labels, TeacherHidden(h, W), T, 1.0, k, 4)
    assert abs(out.kd.item()) <= 1e-4


@pytest.mark.parametrize("z_loss", [0.0, 1e-2], ids=["ce", "ce+z"])
@pytest.mark.parametrize("chunk", [7, 1000], ids=["chunks", "one-chunk"])
def test_cross_entropy_alone_matches_autograd_for_any_upstream_gradient(z_loss, chunk):
    """Without a teacher the chunk's logits are worked on in place (`_ce_chunk`), and backward scales the
    stored gradients in place: values and gradients still equal the direct expression's, times 3."""
    hs, W, _, _, labels = _inputs(seed=8)
    grads = []
    for ours in (True, False):
        h, w = hs.clone().requires_grad_(), W.clone().requires_grad_()
        if ours:
            loss = kd_loss(h, w, labels, None, chunk_tokens=chunk, z_loss=z_loss).loss
        else:
            keep = labels.flatten() != -100
            logits = (h @ w.T).flatten(0, 1)[keep]
            loss = F.cross_entropy(logits, labels.flatten()[keep]) + z_loss * logits.logsumexp(-1).square().mean()
        (3.0 * loss).backward()
        grads.append((loss.detach(), h.grad, w.grad))
    for ours, direct in zip(*grads, strict=True):
        torch.testing.assert_close(ours, direct, rtol=1e-5, atol=1e-6)


def test_a_unit_upstream_gradient_hands_the_stored_gradients_on_as_they_are():
    """loss.backward() skips the scaling pass: its gradients are exactly half those of (2 * loss).backward()."""
    hs, W, _, _, labels = _inputs(seed=4)
    grads = []
    for factor in (1.0, 2.0):
        h, w = hs.clone().requires_grad_(), W.clone().requires_grad_()
        loss = kd_loss(h, w, labels, None, chunk_tokens=16).loss
        (loss if factor == 1.0 else factor * loss).backward()
        grads.append((h.grad, w.grad))
    (h1, w1), (h2, w2) = grads
    assert torch.equal(h2, 2 * h1) and torch.equal(w2, 2 * w1) and h1.abs().sum() > 0


def test_a_second_backward_through_one_loss_is_refused():
    hs, W, _, _, labels = _inputs(seed=9)
    loss = kd_loss(hs.requires_grad_(), W, labels, None).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def _inner_dimensions(prof) -> list[int]:
    """The inner dimension of every matrix product a profile recorded (its first factor's columns)."""
    factor = {"aten::mm": 0, "aten::addmm_": 1}  # addmm_(total, a, b): a @ b added to total
    return [event.input_shapes[factor[event.name]][1] for event in prof.events() if event.name in factor]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("loop", [True, False], ids=["ce-loop", "torch-ce"])
@pytest.mark.parametrize("teacher", [False, True], ids=["ce", "kd"])
def test_the_head_gradient_of_a_group_of_chunks_is_one_product(monkeypatch, precision, loop, teacher):
    """Chunks whose logits share the group buffer get one head-gradient product over all their tokens (here
    groups of 2 of 5 chunks: 32, 32 and 13 tokens); gradients equal those of one product per chunk, to the
    rounding of the sums' order (bf16: the product rounded once instead of per chunk)."""
    from ropelab.train import loss as loss_module
    if not loop:
        monkeypatch.setattr(loss_module, "ce_chunk", lambda *args: None)
    hs, W, ht, Wt, labels = _inputs(seed=13, T=40, V=300, C=24, ignore=(0, 1, 2))
    targets = TeacherHidden(ht, Wt) if teacher else None
    results = {}
    for name, group_bytes in (("grouped", 2 * 16 * 300 * (4 if precision == "fp32" else 2)), ("per-chunk", 0)):
        monkeypatch.setattr(loss_module, "GROUP_BYTES", group_bytes)
        h, w = hs.clone().requires_grad_(), W.clone().requires_grad_()
        with torch.profiler.profile(record_shapes=True) as prof:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                out = kd_loss(h, w, labels, targets, 1.0, 1.0, None, 16)
        out.loss.backward()
        results[name] = (out.loss.detach(), h.grad, w.grad, _inner_dimensions(prof))
    (loss, h_grad, w_grad, inner), (loss1, h_grad1, w_grad1, inner1) = results["grouped"], results["per-chunk"]
    other = (12, 24, 300)  # the inner dimensions of the logits (the teacher's C, the student's) and of grad_h (V)
    head_gradients = sorted(k for k in inner if k not in other)
    # under bf16 the gradient of torch's ops (a teacher's, or with the loop off) is fp32, cast: its own product
    deferred = precision == "fp32" or (loop and not teacher)
    assert head_gradients == ([13, 32, 32] if deferred else [13, 16, 16, 16, 16])
    assert sorted(k for k in inner1 if k not in other) == [13, 16, 16, 16, 16]
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(loss, loss1, rtol=0, atol=0)
    torch.testing.assert_close(h_grad, h_grad1, rtol=0, atol=0)
    torch.testing.assert_close(w_grad, w_grad1, **tol)
