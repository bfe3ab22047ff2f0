"""Training objectives: chunked CE equals the model's own loss; KD wiring, mixing and masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ropelab.config import build_run_config
from ropelab.data.loader import Batch
from ropelab.train.loss import TeacherHidden
from ropelab.distill.objective import DistillObjective, build_objective
from ropelab.train.objectives import build_objective as train_objective, cross_entropy_objective
from ropelab.model import Transformer


def _model(seed=0):
    config = build_run_config(overrides=["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
                                         "model.vocab_size=320", "data.seq_len=16"])
    torch.manual_seed(seed)
    return Transformer(config.model)


def _batch(seed=0, vocab=259):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    labels = torch.randint(0, vocab, (2, 16), generator=g)
    labels[1, :3] = -100
    docs = torch.tensor([[0] * 6 + [1] * 10, [4] * 9 + [5] * 7])
    return Batch(ids, labels, torch.arange(16).expand(2, 16), docs)


def test_cross_entropy_objective_matches_model_loss_and_gradients():
    model, reference = _model(), _model()
    batch = _batch()
    loss, figures = cross_entropy_objective(chunk_tokens=7, z_loss=1e-2)(model, batch)
    loss.backward()
    logits, ce = reference(batch.input_ids, batch.labels, batch.position_ids)
    z = torch.logsumexp(logits.float(), -1)[batch.labels != -100].pow(2).mean()
    (ce + 1e-2 * z).backward()
    assert loss.item() == pytest.approx((ce + 1e-2 * z).item(), rel=1e-5)
    assert figures["ce"] == pytest.approx(ce.item(), rel=1e-5) and figures["z_loss"] == pytest.approx(z.item(), rel=1e-5)
    assert "kd" not in figures
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


class _RecordingSource:
    """A teacher source with fixed hidden states that records what the objective passes it."""

    def __init__(self, hidden, weight):
        self.hidden, self.weight, self.calls = hidden, weight, []

    def targets(self, input_ids, position_ids, doc_ids=None, out_device=None):
        self.calls.append(doc_ids)
        return TeacherHidden(self.hidden, self.weight)


@pytest.mark.parametrize("use_doc_mask", [False, True])
def test_distill_objective_mixes_kd_and_ce_and_passes_document_ids(use_doc_mask):
    model, batch = _model(), _batch(1)
    g = torch.Generator().manual_seed(2)
    source = _RecordingSource(torch.randn(2, 16, 8, generator=g), torch.randn(259, 8, generator=g))
    config = build_run_config(overrides=["distill.teacher=x", "distill.alpha=0.25", "distill.temperature=2"]).distill
    loss, figures = DistillObjective(source, config, use_doc_mask)(model, batch)

    assert (source.calls[0] is batch.doc_ids) == use_doc_mask and (source.calls[0] is None) != use_doc_mask
    with torch.no_grad():
        hidden = model.hidden_states(batch.input_ids, batch.position_ids, batch.doc_ids if use_doc_mask else None)
        logits = model.lm_head(hidden)
    keep = batch.labels != -100
    ce = F.cross_entropy(logits[keep], batch.labels[keep])
    logq = F.log_softmax(logits[keep] / 2, -1)[:, :259]
    logp = F.log_softmax((source.hidden @ source.weight.T)[keep] / 2, -1)
    kd = 4 * F.kl_div(logq, logp, log_target=True, reduction="batchmean")
    assert figures["kd"] == pytest.approx(kd.item(), rel=1e-5) and figures["ce"] == pytest.approx(ce.item(), rel=1e-5)
    assert loss.item() == pytest.approx(0.25 * kd.item() + 0.75 * ce.item(), rel=1e-5)


def test_build_objective_with_the_student_as_its_own_teacher(make_ropelab_teacher, student_config):
    """Same weights: the teacher's distribution is the student's over the 259 real tokens, and the
    student also puts mass m on its 61 padding rows, so q = (1 - m) p there and KL(p || q) = -log(1 - m)."""
    from ropelab.sources import load

    run = make_ropelab_teacher()
    student, _, _ = load(run)
    assert train_objective(student_config(), "cpu").source is None  # no distill section: cross-entropy
    batch = _batch(3)
    full = build_objective(student_config(f"distill.teacher={run}"))
    loss, figures = full(student, batch)
    with torch.no_grad():
        logits, ce = student(batch.input_ids, batch.labels, batch.position_ids)
    keep = batch.labels != -100
    m = torch.softmax(logits[keep], -1)[:, 259:].sum(-1)
    assert figures["kd"] == pytest.approx(-torch.log1p(-m).mean().item(), rel=1e-4)
    assert figures["ce"] == pytest.approx(ce.item(), rel=1e-5) and loss.item() == pytest.approx(figures["kd"])

    top = build_objective(student_config(f"distill.teacher={run}", "distill.top_k=7"), previous=full)
    assert top.source is full.source
    _, top_figures = top(student, batch)
    assert 0 < top_figures["kd"] <= figures["kd"]  # merging outcomes never increases the KL
