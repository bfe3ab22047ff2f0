import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab import attention
from ropelab.attention import Documents, attend, bucket_lengths, resolve_backend
from ropelab.config import ModelConfig
from tests.helpers import fit_lengths
from ropelab.model import Transformer


def ids_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    """(B, T) document ids from per-row document lengths (every row sums to the same T)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def per_document(q, k, v, rows):
    """Reference: every document run alone through causal SDPA, results laid back in place."""
    out = torch.empty_like(q)
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            piece = slice(start, start + n)
            out[b : b + 1, :, piece] = F.scaled_dot_product_attention(
                q[b : b + 1, :, piece], k[b : b + 1, :, piece].repeat_interleave(q.shape[1] // k.shape[1], 1),
                v[b : b + 1, :, piece].repeat_interleave(q.shape[1] // k.shape[1], 1), is_causal=True)
            start += n
    return out


def outputs_and_grads(fn, q, k, v, upstream):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad((out * upstream).sum(), (q, k, v)))


document_rows = st.integers(1, 3).flatmap(
    lambda batch: st.integers(4, 48).flatmap(
        lambda T: st.lists(
            st.lists(st.integers(1, 40), min_size=1, max_size=8).map(lambda ls, T=T: fit_lengths(ls, T)),
            min_size=batch, max_size=batch)))


@settings(max_examples=25, deadline=None)
@given(rows=document_rows, kv_heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_masked_backends_match_documents_run_alone(rows, kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, D = len(rows), sum(rows[0]), 4, 8
    q, k, v, upstream = (torch.randn(B, h, T, D, generator=gen) for h in (H, kv_heads, kv_heads, H))
    ids = ids_from_lengths(rows)
    expected = outputs_and_grads(lambda q, k, v: per_document(q, k, v, rows), q, k, v, upstream)
    for backend in ("dense", "varlen"):
        got = outputs_and_grads(lambda q, k, v: attend(q, k, v, ids, backend), q, k, v, upstream)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{backend} {name}: {m}")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_matches_dense():
    pytest.importorskip("torch.nn.attention.flex_attention")
    rows = [[5, 17, 3, 7], [1, 1, 10, 20]]
    ids = ids_from_lengths(rows)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 32, 8, generator=gen) for h in (4, 2, 2))
    with torch.no_grad():
        torch.testing.assert_close(attend(q, k, v, ids, "flex"), per_document(q, k, v, rows), atol=1e-5, rtol=1e-5)


def test_varlen_accepts_token_major_views_as_the_model_makes_them():
    """q/k/v as (B, T, H, D).transpose(1, 2) views and one contiguous group (the free-view path)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 64, 2, 8, generator=gen).transpose(1, 2) for _ in range(3))
    rows = [[16, 16, 16, 16]]
    torch.testing.assert_close(attend(q, k, v, ids_from_lengths(rows), "varlen"), per_document(q, k, v, rows), atol=1e-6, rtol=1e-6)


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 40_000))
def test_bucket_pads_at_most_a_quarter(n):
    padded = int(bucket_lengths(torch.tensor([n]))[0])
    assert n <= padded <= (n if n < 8 else n * 5 / 4)
    assert len({int(x) for x in bucket_lengths(torch.arange(n, 2 * n))}) <= 5  # few sizes per octave


def test_plan_groups_by_bucket_and_maps_every_token_back():
    ids = ids_from_lengths([[3, 5, 3, 100, 101, 4], [200, 16]])
    plan = Documents(ids).plan()
    assert plan.shapes == [(2, 3), (1, 4), (1, 5), (1, 16), (2, 112), (1, 224)]  # 100 and 101 share a bucket
    source, back, real = plan.layout(3)
    assert source.numel() == 3 * sum(rows * length for rows, length in plan.shapes) and not plan.identity
    assert torch.equal(source[back], torch.arange(3 * ids.numel())) and real[back].all()
    assert int(real.sum()) == 3 * ids.numel()
    assert Documents(ids_from_lengths([[8, 8, 8]])).plan().identity


def test_cu_seqlens_restart_at_every_row():
    ids = torch.tensor([[0, 0, 1, 1, 1], [4, 4, 4, 4, 4], [7, 8, 8, 9, 9]])
    assert Documents(ids).cu_seqlens().tolist() == [0, 2, 5, 10, 11, 13, 15]


def test_auto_backend_choice():
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert resolve_backend("auto", None, torch.device("cpu")) == "sdpa"
    assert resolve_backend("auto", ids, torch.device("cpu")) == "varlen"
    assert resolve_backend("dense", None, torch.device("cpu")) == "sdpa"
    assert resolve_backend("sdpa", ids, torch.device("cpu")) == "sdpa"


def _tiny_model(block: str) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=61, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48, block=block, max_seq_len=128)
    return Transformer(config)


@pytest.mark.parametrize("positions", ["running", "restart"])
@pytest.mark.parametrize("backend, block", [("varlen", "sequential"), ("dense", "parallel")])
def test_packed_window_equals_each_document_alone(positions, backend, block):
    """Logits and weight gradients of one packed, document-masked window equal those of its
    documents run one by one, with position ids as configured (<= 1e-5, fp32)."""
    model = _tiny_model(block)
    model.set_attention_backend(backend)
    lengths = [7, 1, 19, 12, 9]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 61, (1, T), generator=gen)
    targets = torch.randint(0, 61, (1, T), generator=gen)
    ids = ids_from_lengths([lengths])
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    running = torch.arange(T)[None]
    pos = running if positions == "running" else running - starts[ids]

    logits, _ = model(tokens, position_ids=pos, doc_ids=ids)
    F.cross_entropy(logits[0], targets[0], reduction="sum").backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone = []
    for start, n in zip(starts.tolist(), lengths):
        piece = slice(start, start + n)
        out, _ = model(tokens[:, piece], position_ids=pos[:, piece])
        F.cross_entropy(out[0], targets[0, piece], reduction="sum").backward()
        alone.append(out)
    torch.testing.assert_close(logits, torch.cat(alone, 1), atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_boundaries_are_derived_once_per_forward(monkeypatch):
    calls = []
    real = attention.document_mask
    monkeypatch.setattr(attention, "document_mask", lambda ids: calls.append(1) or real(ids))
    model = _tiny_model("sequential")
    model.set_attention_backend("dense")
    model(torch.zeros(1, 6, dtype=torch.long), doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]))
    assert len(calls) == 1 and len(model.blocks) == 2


def test_cpu_sdpa_gets_contiguous_keys_and_values_only_without_a_cache(monkeypatch):
    """Full-length causal attention on CPU hands SDPA contiguous k and v (its flash kernel runs faster so;
    BENCHMARKS.md) with the same result; a cached call (fewer queries than keys) passes the cache's own views."""
    from ropelab import attention_windows
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((k.is_contiguous(), v.is_contiguous()))
        return real(q, k, v, **kwargs)

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 16, 4 * 8 + 2 * 2 * 8, generator=g)  # (B, T, (H + 2K) D) as the projections make it
    q = qkv[..., :32].view(2, 16, 4, 8).transpose(1, 2)
    k = qkv[..., 32:48].view(2, 16, 2, 8).transpose(1, 2)
    v = qkv[..., 48:].view(2, 16, 2, 8).transpose(1, 2)
    expected = real(q, k, v, is_causal=True, enable_gqa=True)
    monkeypatch.setattr(attention_windows.F, "scaled_dot_product_attention", spy)
    torch.testing.assert_close(attend(q, k, v), expected)
    attend(q[:, :, -1:], k, v)
    assert seen == [(True, True), (False, False)]
