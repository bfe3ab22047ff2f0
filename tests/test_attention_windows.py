"""Sliding-window and chunked attention: every backend against a dense reference built from HF
transformers' own mask functions (values and gradients, fp32)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import masking_utils as hf_masks

from ropelab import attention
from ropelab.attention import Documents, attend, resolve_backend
from ropelab.attention_windows import check_window
from tests.helpers import fit_lengths

H, KV_HEADS, D = 4, 2, 8


def hf_mask(ids, queries, keys, window, left_padding=None):
    """(B, 1, queries, keys) mask for the last `queries` of `keys` tokens from HF's mask functions;
    `left_padding` (B,): where each row's chunks begin (none: 0)."""
    batch = torch.arange(1 if ids is None else ids.shape[0]).view(-1, 1, 1)
    if window is None:
        rule = hf_masks.causal_mask_function
    elif window[0] == "sliding":
        rule = hf_masks.sliding_window_causal_mask_function(window[1])
    else:
        padding = torch.zeros(batch.shape[0], dtype=torch.long) if left_padding is None else left_padding
        rule = hf_masks.chunked_causal_mask_function(window[1], padding)
    if ids is not None:
        rule = hf_masks.and_masks(rule, hf_masks.packed_sequence_mask_function(ids))
    q_idx = torch.arange(keys - queries, keys).view(1, -1, 1)
    kv_idx = torch.arange(keys).view(1, 1, -1)
    return rule(batch, 0, q_idx, kv_idx).expand(batch.shape[0], queries, keys).unsqueeze(1)


def reference(q, k, v, ids, window, left_padding=None):
    groups = q.shape[1] // k.shape[1]
    mask = hf_mask(ids, q.shape[2], k.shape[2], window, left_padding)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def outputs_and_grads(fn, q, k, v, upstream):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad((out * upstream).sum(), (q, k, v)))


def assert_matches_reference(backend, q, k, v, ids, window, label="", left_padding=None):
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    expected = outputs_and_grads(lambda q, k, v: reference(q, k, v, ids, window, left_padding), q, k, v, upstream)
    docs = ids if left_padding is None else Documents(ids, chunk_start=left_padding)
    got = outputs_and_grads(lambda q, k, v: attend(q, k, v, docs, backend, window), q, k, v, upstream)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{label} {backend} {window} {name}: {m}")


def ids_from_lengths(rows):
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def token_major(B, T, heads, seed):
    """(B, heads, T, D) as the model's projections make them: a (B, T, heads, D) tensor's transposed view."""
    return torch.randn(B, T, heads, D, generator=torch.Generator().manual_seed(seed)).transpose(1, 2)


# 150 tokens: W=20 takes the blocked path (64-query blocks, 83 keys each) and leaves a padded last block;
# the documents give varlen a group long enough for blocks (100), one for a masked call (43) and one
# shorter than the window (7); C=16 does not divide 150 either
ROWS = [[100, 7, 43], [30, 120]]


@pytest.mark.parametrize("window", [("sliding", 20), ("chunked", 16), ("sliding", 1)])
@pytest.mark.parametrize("backend, documents", [("sdpa", False), ("local", False), ("auto", False), ("dense", True),
                                                ("varlen", True), ("local", True), ("auto", True)])
def test_backends_match_the_reference(backend, documents, window):
    q, k, v = token_major(2, 150, H, 0), token_major(2, 150, KV_HEADS, 1), token_major(2, 150, KV_HEADS, 2)
    ids = ids_from_lengths(ROWS) if documents else None
    assert_matches_reference(backend, q, k, v, ids, window)


@pytest.mark.parametrize("size", [300, 600])
@pytest.mark.parametrize("documents", [False, True])
def test_windows_wider_than_a_block_read_several_earlier_blocks(size, documents):
    """256-query blocks: W=300 reads 2 earlier blocks, W=600 reads 3, the first ones partly before the row."""
    q, k, v = token_major(1, 700, H, 15), token_major(1, 700, KV_HEADS, 16), token_major(1, 700, KV_HEADS, 17)
    ids = ids_from_lengths([[290, 10, 400]]) if documents else None
    assert_matches_reference("local", q, k, v, ids, ("sliding", size))


def test_auto_blocks_small_windows_and_masks_large_ones():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", None, cpu, ("sliding", 128), 4096) == "local"
    assert resolve_backend("auto", None, cpu, ("chunked", 2048), 4096) == "local"
    assert resolve_backend("auto", None, cpu, ("sliding", 4000), 4096) == "sdpa"
    assert resolve_backend("auto", None, cpu, None, 4096) == "sdpa"
    assert resolve_backend("local", None, cpu, None, 4096) == "sdpa"  # full-attention layers: what auto runs
    assert resolve_backend("auto", torch.zeros(1, 8), cpu, ("sliding", 2), 8) == "varlen"


document_rows = st.integers(1, 2).flatmap(
    lambda batch: st.integers(1, 160).flatmap(
        lambda T: st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=6).map(lambda ls, T=T: fit_lengths(ls, T)),
                           min_size=batch, max_size=batch)))


@settings(max_examples=20, deadline=None)
@given(rows=document_rows, kind=st.sampled_from(["sliding", "chunked"]), size=st.integers(1, 170),
       documents=st.booleans(), backend=st.sampled_from(["auto", "dense", "varlen", "local"]),
       seed=st.integers(0, 2**16))
def test_windows_match_the_reference_for_any_documents(rows, kind, size, documents, backend, seed):
    B, T = len(rows), sum(rows[0])
    q, k, v = token_major(B, T, H, seed), token_major(B, T, KV_HEADS, seed + 1), token_major(B, T, KV_HEADS, seed + 2)
    ids = ids_from_lengths(rows) if documents else None
    assert_matches_reference(backend, q, k, v, ids, (kind, size), label=f"rows={rows}")


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("window", [("sliding", 5), ("chunked", 6)])
def test_cached_decoding_equals_the_full_forward(window, documents):
    """Queries for the last tokens against all keys so far (a KV cache) give the full forward's last rows."""
    T = 40
    q, k, v = token_major(1, T, H, 3), token_major(1, T, KV_HEADS, 4), token_major(1, T, KV_HEADS, 5)
    ids = ids_from_lengths([[13, 2, 25]]) if documents else None
    full = attend(q, k, v, ids, "dense", window)
    for t in range(1, T + 1):  # one token at a time
        step = attend(q[:, :, t - 1 : t], k[:, :, :t], v[:, :, :t], None if ids is None else ids[:, :t], "auto", window)
        torch.testing.assert_close(step, full[:, :, t - 1 : t], atol=1e-6, rtol=1e-6)
    prefill = attend(q[:, :, -9:], k, v, ids, "varlen", window)  # several queries at once
    torch.testing.assert_close(prefill, full[:, :, -9:], atol=1e-6, rtol=1e-6)
    assert_matches_reference("auto", q[:, :, -9:], k, v, ids, window)


# a left-padded batch: padding is document 0 and each row's tokens document 1; 10 tokens of padding
# put the chunks of 6 (and 16) of the last row two tokens (six tokens) off those of a row from token 0
LEFT_PADDING = torch.tensor([0, 3, 10])
LEFT_PADDED = (torch.arange(40) >= LEFT_PADDING.view(-1, 1)).long()


@pytest.mark.parametrize("window", [("chunked", 6), ("chunked", 16), ("sliding", 5)])
@pytest.mark.parametrize("backend", ["dense", "varlen", "local", "auto"])
def test_left_padded_rows_count_chunks_from_their_first_token(backend, window):
    """Documents' chunk_start: chunks begin at each row's first real token, as transformers' chunked mask
    has them in a left-padded batch (a sliding window is the same either way)."""
    q, k, v = token_major(3, 40, H, 18), token_major(3, 40, KV_HEADS, 19), token_major(3, 40, KV_HEADS, 20)
    assert_matches_reference(backend, q, k, v, LEFT_PADDED, window, left_padding=LEFT_PADDING)


@pytest.mark.parametrize("window", [("chunked", 6), ("sliding", 5)])
def test_left_padded_rows_decode_one_token_at_a_time(window):
    """The same with a KV cache: each query against the keys so far, for the rows where it is a real token
    (a padding query's output is never read; with fewer keys than a chunk it sees all earlier padding)."""
    q, k, v = token_major(3, 40, H, 21), token_major(3, 40, KV_HEADS, 22), token_major(3, 40, KV_HEADS, 23)
    full = reference(q, k, v, LEFT_PADDED, window, LEFT_PADDING)
    for t in range(1, 41):
        docs = Documents(LEFT_PADDED[:, :t], chunk_start=LEFT_PADDING)
        step = attend(q[:, :, t - 1 : t], k[:, :, :t], v[:, :, :t], docs, "auto", window)
        real = t - 1 >= LEFT_PADDING
        torch.testing.assert_close(step[real], full[real, :, t - 1 : t], atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [("chunked", 6), ("sliding", 5)])
def test_flex_forward_counts_chunks_from_the_first_token(window):
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = token_major(3, 40, H, 24), token_major(3, 40, KV_HEADS, 25), token_major(3, 40, KV_HEADS, 26)
    with torch.no_grad():
        flex = attend(q, k, v, Documents(LEFT_PADDED, chunk_start=LEFT_PADDING), "flex", window)
    torch.testing.assert_close(flex, reference(q, k, v, LEFT_PADDED, window, LEFT_PADDING), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
@pytest.mark.parametrize("backend, documents", [("auto", False), ("local", False), ("dense", True), ("varlen", True)])
def test_a_window_of_the_whole_row_is_full_attention(kind, backend, documents):
    T = 33
    q, k, v = token_major(2, T, H, 6), token_major(2, T, KV_HEADS, 7), token_major(2, T, KV_HEADS, 8)
    ids = ids_from_lengths([[10, 23], [33]]) if documents else None
    for size in (T, T + 50):
        torch.testing.assert_close(attend(q, k, v, ids, backend, (kind, size)), attend(q, k, v, ids, backend))


def test_layers_with_different_windows_share_one_documents(monkeypatch):
    calls = []
    real = attention.document_mask
    monkeypatch.setattr(attention, "document_mask", lambda ids: calls.append(1) or real(ids))
    q, k, v = token_major(2, 64, H, 9), token_major(2, 64, KV_HEADS, 10), token_major(2, 64, KV_HEADS, 11)
    ids = ids_from_lengths([[20, 44], [64]])
    docs = Documents(ids)
    windows = [None, ("sliding", 8), ("chunked", 16), ("sliding", 8), None, ("chunked", 16)]
    for window in windows:
        with torch.no_grad():
            torch.testing.assert_close(attend(q, k, v, docs, "dense", window), reference(q, k, v, ids, window),
                                       atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(attend(q, k, v, docs, "varlen", window), reference(q, k, v, ids, window),
                                       atol=1e-6, rtol=1e-6)
    assert len(calls) == 3  # one dense mask per distinct window


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [("sliding", 6), ("chunked", 8), None])
def test_flex_forward_honours_windows(window):
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = token_major(2, 40, H, 12), token_major(2, 40, KV_HEADS, 13), token_major(2, 40, KV_HEADS, 14)
    ids = ids_from_lengths([[5, 17, 18], [1, 39]])
    docs = Documents(ids)
    with torch.no_grad():
        torch.testing.assert_close(attend(q, k, v, docs, "flex", window), reference(q, k, v, ids, window),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [("full", 4), ("sliding", 0), ("chunked", 2.5), ("sliding",), "sliding"])
def test_bad_windows_are_refused(window):
    with pytest.raises(ValueError, match="attention window"):
        check_window(window, 16)
