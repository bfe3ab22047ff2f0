"""ropelab.train.cross_entropy_kernel: the CPU loop gives the torch path's cross-entropy, logsumexp^2 and
gradients to a few float32 roundings (to one bf16 rounding where the gradient is bf16), through kd_loss
in fp32 and under bf16 autocast, and declines what it cannot run."""

from __future__ import annotations

import pytest
import torch

from ropelab.train import cross_entropy_kernel, loss
from ropelab.train.cross_entropy_kernel import ce_chunk
from ropelab.train.loss import kd_loss

pytestmark = pytest.mark.skipif(cross_entropy_kernel.library() is None,
                                reason="the C loop is unavailable here (no compiler, or ROPELAB_CPU_KERNEL=0)")


def logits_and_labels(dtype, n=37, vocab=3001, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=gen) * 4).to(dtype), torch.randint(0, vocab, (n,), generator=gen)


@pytest.mark.parametrize("z_loss", [0.0, 1e-2], ids=["ce", "ce+z"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_loop_gives_the_torch_chunks_sums_and_gradient(dtype, z_loss):
    logits, labels = logits_and_labels(dtype)
    sums, grad = ce_chunk(logits.clone(), labels, 1.0, z_loss, 1 / 37)
    expected_sums, expected = loss._ce_chunk(logits.float().clone(), labels, 1.0, z_loss, 1 / 37)
    torch.testing.assert_close(sums, expected_sums, rtol=1e-6, atol=0)
    assert grad.dtype == dtype and grad.shape == logits.shape
    eps = torch.finfo(dtype).eps * (1 if dtype == torch.bfloat16 else 8)
    expected = expected.to(dtype)
    torch.testing.assert_close(grad, expected, rtol=eps, atol=eps * expected.abs().max().item())
    no_grad_sums, none = ce_chunk(logits.clone(), labels, 1.0, z_loss, None)
    assert none is None and torch.equal(no_grad_sums, sums)


def test_the_loop_keeps_torchs_special_values():
    logits, labels = logits_and_labels(torch.float32, n=4, vocab=64)
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")  # nothing possible: lse -inf, NaN gradient as torch gives
    logits[2, 7] = float("inf")
    logits[3, :] = 0.0
    logits[3, labels[3]] = 80.0  # a certain label: CE 0, gradient 0
    sums, grad = ce_chunk(logits.clone(), labels, 1.0, 0.0, 1.0)
    expected_sums, expected = loss._ce_chunk(logits.clone(), labels, 1.0, 0.0, 1.0)
    assert torch.equal(sums.isnan(), expected_sums.isnan())
    assert torch.equal(grad.isnan(), expected.isnan())
    finite = expected.isfinite()
    torch.testing.assert_close(grad[finite], expected[finite], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_kd_loss_without_a_teacher_with_and_without_the_loop(precision, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    hidden, head = torch.randn(2, 45, 32, generator=gen), torch.randn(777, 32, generator=gen) * 0.5
    labels = torch.randint(0, 777, (2, 45), generator=gen)
    labels[0, :7] = -100
    results = []
    for loop in (True, False):
        if not loop:
            monkeypatch.setattr(cross_entropy_kernel, "library", lambda: None)
        h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            out = kd_loss(h, w, labels, None, chunk_tokens=16, z_loss=1e-3)
        (2.0 * out.loss).backward()
        results.append((out.loss.detach(), out.ce, out.z, h.grad, w.grad))
    eps = torch.finfo(torch.bfloat16 if precision != "fp32" else torch.float32).eps * 8
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=eps, atol=eps * theirs.abs().max().item())


def test_what_the_loop_declines():
    logits, labels = logits_and_labels(torch.float32, n=4, vocab=10)
    assert ce_chunk(logits.double(), labels, 1.0, 0.0, 1.0) is None
    assert ce_chunk(logits.t().contiguous().t(), labels, 1.0, 0.0, 1.0) is None  # not contiguous
    assert ce_chunk(logits, labels.int(), 1.0, 0.0, 1.0) is None
    assert ce_chunk(logits, labels[:3], 1.0, 0.0, 1.0) is None
    bad = labels.clone()
    bad[2] = 10
    assert ce_chunk(logits, bad, 1.0, 0.0, 1.0) is None  # torch's indexing then raises its own error
    with pytest.raises((IndexError, RuntimeError)):
        kd_loss(logits[None, :, :], torch.eye(10), bad[None], None)
