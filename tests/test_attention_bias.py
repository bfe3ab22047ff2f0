"""A score bias on every attention backend against an explicit softmax over HF transformers' masks
(values and gradients, fp32): documents, windows, left-padded rows, grouped heads, a KV cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.attention import Documents, attend, flex_available, resolve_backend
from ropelab.config.position import AlibiSpec
from ropelab.position.alibi import Alibi
from tests.test_attention_windows import hf_mask, ids_from_lengths, outputs_and_grads

H, KV_HEADS, D, T = 4, 2, 8, 37
# on LONG tokens a 20-token window takes local's blocked path (64-query blocks reading the block before,
# a padded last block), also for varlen's 140-token document
WINDOWS = [None, ("sliding", 3), ("sliding", 20), ("chunked", 5)]
LONG = 150


class TableBias(torch.nn.Module):
    """A relative bias of no particular shape (as T5's): a random value per head and distance. ALiBi's
    is linear, so a constant error in a query's distances cancels in its softmax; here it shows."""

    def __init__(self, heads: int, reach: int = 80):
        super().__init__()
        self.reach = reach
        self.table = torch.randn(heads, reach + 1, generator=torch.Generator().manual_seed(3))

    def bias(self, distance):
        return self.table[:, distance.clamp(0, self.reach)]

    def score_mod(self):
        table, reach = self.table, self.reach

        def table_bias(score, batch, head, query_index, key_index):
            return score + table[head, (query_index - key_index).clamp(0, reach)]

        return table_bias


BIASES = {"table": TableBias(H), "alibi": Alibi(AlibiSpec(max_bias=4.0), H)}


def reference(q, k, v, ids, window, bias, left_padding=None):
    """softmax(q k^T / sqrt(D) + bias(i - j)) v over HF's mask, i and j the token indices in the row."""
    queries, keys = q.shape[2], k.shape[2]
    mask = hf_mask(ids, queries, keys, window, left_padding)  # (B, 1, queries, keys)
    distance = torch.arange(keys - queries, keys).view(-1, 1) - torch.arange(keys)
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q @ k.transpose(-1, -2) / D**0.5 + bias.bias(distance)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def tensors(tokens, seed=0, rows=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, H, tokens, D, generator=g), torch.randn(rows, KV_HEADS, tokens, D, generator=g),
            torch.randn(rows, KV_HEADS, tokens, D, generator=g))


def assert_backend_matches(backend, q, k, v, ids, window, bias, left_padding=None):
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    expected = outputs_and_grads(lambda *x: reference(*x, ids, window, bias, left_padding), q, k, v, upstream)
    docs = ids if left_padding is None else Documents(ids, chunk_start=left_padding)
    got = outputs_and_grads(lambda *x: attend(*x, docs, backend, window, score_bias=bias), q, k, v, upstream)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=lambda m: f"{backend} {window} {name}: {m}")


@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("backend, documents", [("sdpa", False), ("local", False), ("auto", False), ("dense", True),
                                                ("varlen", True), ("local", True), ("auto", True)])
def test_every_backend_adds_the_bias_as_the_reference_does(backend, documents, window, bias):
    tokens = LONG if window == ("sliding", 20) else T
    q, k, v = tensors(tokens)
    ids = ids_from_lengths([[9, 1, tokens - 10], [tokens - 40, 40]] if tokens == LONG else [[9, 1, 27], [20, 17]])
    assert_backend_matches(backend, q, k, v, ids if documents else None, window, BIASES[bias])


@settings(max_examples=20, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=4), min_size=1, max_size=3),
       window=st.sampled_from(WINDOWS[:2] + WINDOWS[3:]), backend=st.sampled_from(["dense", "varlen", "local"]))
def test_any_documents_get_the_bias_of_their_token_distances(rows, window, backend):
    ids = ids_from_lengths([row + [48 - sum(row)] for row in rows])
    q, k, v = tensors(48, rows=len(rows))
    assert_backend_matches(backend, q, k, v, ids, window, BIASES["table"])


@pytest.mark.parametrize("window", [("chunked", 4), ("sliding", 3)])
@pytest.mark.parametrize("backend", ["dense", "varlen", "local", "auto"])
def test_left_padded_rows_count_chunks_from_their_first_token(backend, window):
    ids = torch.tensor([[0] * 3 + [1] * 14, [1] * 17])
    q, k, v = tensors(17)
    assert_backend_matches(backend, q, k, v, ids, window, BIASES["table"], left_padding=torch.tensor([3, 0]))


@pytest.mark.parametrize("window", [None, ("chunked", 4)])
def test_local_takes_a_rows_chunk_start_without_documents_nor_a_bias(window):
    """Shifted chunks stay on the local kernel (blocks of a chunk reading the block before)."""
    q, k, v = tensors(17)
    starts = torch.tensor([3, 1])
    docs = Documents(torch.zeros(2, 17, dtype=torch.long), chunk_start=starts)
    assert resolve_backend("local", docs, torch.device("cpu"), window, 17) == ("varlen" if window is None else "local")
    got = attend(q, k, v, docs, "local", window)
    torch.testing.assert_close(got, attend(q, k, v, docs, "dense", window), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, ("sliding", 4), ("chunked", 5)])
@pytest.mark.parametrize("documents", [False, True])
def test_cached_decoding_with_a_bias_equals_the_full_forward(window, documents):
    """Keys held from `key_start` on, as a windowed layer's cache keeps them."""
    q, k, v = tensors(T)
    ids = ids_from_lengths([[9, 1, 27], [20, 17]]) if documents else None
    bias = BIASES["table"]
    full = attend(q, k, v, ids, "dense", window, score_bias=bias)
    for end in (10, 11, 23, T):
        key_start = 0 if window is None else max(0, end - 12)
        got = attend(q[:, :, end - 3 : end], k[:, :, key_start:end], v[:, :, key_start:end],
                     None if ids is None else ids[:, :end], "auto", window, key_start, bias)
        torch.testing.assert_close(got, full[:, :, end - 3 : end], atol=1e-5, rtol=1e-5)


def test_a_biased_cache_missing_a_key_is_refused():
    q, k, v = tensors(T)
    with pytest.raises(ValueError, match="the cache holds them from token 5 only"):
        attend(q[:, :, -2:], k[:, :, 5:], v[:, :, 5:], None, "auto", ("sliding", 40), 5, BIASES["alibi"])


@pytest.mark.parametrize("window", [None, ("chunked", 5)])
def test_flex_takes_the_bias_as_its_score_mod(window):
    if not flex_available():
        pytest.skip("no flex attention in this torch")
    q, k, v = tensors(T)
    ids = ids_from_lengths([[9, 1, 27], [20, 17]])
    with torch.no_grad():  # no CPU backward for flex
        torch.testing.assert_close(attend(q, k, v, ids, "flex", window, score_bias=BIASES["table"]),
                                   reference(q, k, v, ids, window, BIASES["table"]), atol=2e-5, rtol=1e-5)


def test_alibis_score_mod_is_built_once_and_again_for_new_slopes():
    alibi = Alibi(AlibiSpec(), H)
    first = alibi.score_mod()
    assert alibi.score_mod() is first
    alibi.rebuild_after_meta()
    assert alibi.score_mod() is not first
    again = alibi.score_mod()
    alibi.to(torch.float64)
    assert alibi.score_mod() is not again
