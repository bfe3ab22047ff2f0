"""The generation cache (`ropelab.kv_cache`): a windowed layer holds only the keys a later query can
see, and generation through it gives the logits of one forward over the whole sequence."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ropelab.attention import attend
from ropelab.attention_windows import first_key
from ropelab.config import LayerKind, ModelConfig
from ropelab.kv_cache import KVCache
from ropelab.model import Transformer
from tests.helpers import randomize_weights

TINY = dict(vocab_size=97, n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=256)
LENGTH = 23


def _model(sliding: int, chunk: int) -> Transformer:
    """One sliding layer (S), one chunked (C), one full NoPE layer (G), weights away from the init."""
    kinds = {"S": LayerKind(attention="sliding", window=sliding), "C": LayerKind(attention="chunked", window=chunk),
             "G": LayerKind(rope="none")}
    return randomize_weights(Transformer(ModelConfig(**TINY, layer_pattern="SCG", layer_kinds=kinds)))


def _held(window, seen: int) -> int:
    """Keys a layer's cache must hold after `seen` tokens: those the next query (token `seen`) can see."""
    return seen - first_key(window, seen)


def _generate(model, ids, ends, doc_ids=None):
    """Logits of `ids` fed through one KVCache in pieces ending at `ends`, and what each layer held after each."""
    cache, pieces, held, start = KVCache(), [], [], 0
    with torch.no_grad():
        for end in ends:
            docs = None if doc_ids is None else doc_ids[:, :end]
            pieces.append(model(ids[:, start:end], doc_ids=docs, kv_cache=cache)[0])
            held.append([k.shape[2] for k in cache.keys])
            assert [v.shape[2] for v in cache.values] == held[-1]
            assert [cache.get_seq_length(layer) for layer in range(3)] == [end] * 3
            start = end
    return torch.cat(pieces, 1), held


@settings(max_examples=25, deadline=None)
@given(sliding=st.integers(1, 9), chunk=st.integers(1, 9),
       cuts=st.sets(st.integers(1, LENGTH - 1), max_size=8), documents=st.booleans())
def test_windowed_layers_hold_only_their_window_and_generate_the_full_forwards_logits(sliding, chunk, cuts, documents):
    """Any prefill length, any pieces after it (one token or several): the logits of one forward over the
    whole sequence, while the sliding layer holds at most W - 1 keys, the chunked one the tokens of the
    current chunk and the full one every token."""
    model = _model(sliding, chunk)
    ids = torch.randint(0, 97, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 6 + [1] * 17, [0] * 13 + [1] * 10]) if documents else None
    ends = sorted(cuts) + [LENGTH]
    with torch.no_grad():
        full, _ = model(ids, doc_ids=doc_ids)
    got, held = _generate(model, ids, ends, doc_ids)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-5)
    windows = [block.attn.window for block in model.blocks]
    assert windows == [("sliding", sliding), ("chunked", chunk), None]
    for end, layers in zip(ends, held):
        assert layers == [_held(window, end) for window in windows]
    assert held[-1][0] == min(sliding - 1, LENGTH) and held[-1][1] == LENGTH % chunk and held[-1][2] == LENGTH


def test_a_long_generation_keeps_the_sliding_layers_memory_at_its_window():
    """200 tokens one at a time: the sliding layer's cache stays at W - 1 keys and values, in tensors of
    their own (the dropped keys' storage is freed, not kept behind a view)."""
    model = _model(sliding=4, chunk=16)
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(2))
    cache = KVCache()
    with torch.no_grad():
        model(ids[:, :5], kv_cache=cache)
        for t in range(5, 200):
            model(ids[:, t:t + 1], kv_cache=cache)
    keys, values = cache.keys[0], cache.values[0]
    assert keys.shape[2] == values.shape[2] == 3
    assert keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()
    assert cache.keys[1].shape[2] == 200 % 16 and cache.keys[2].shape[2] == 200


class _KeepsEveryKey(KVCache):
    """A cache that ignores windows, as the long-context scorer's prefix cache does."""

    def update(self, key, value, layer, cache_kwargs=None):
        return super().update(key, value, layer)


def test_a_cache_holding_a_prompts_keys_goes_on_as_if_it_had_seen_the_prompt():
    """`hold` takes every layer's keys and values of a prompt computed elsewhere (the long-context
    scorer's prefix cache): the next tokens see them at the right positions, and windows drop the rest."""
    model = _model(sliding=3, chunk=4)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    everything = _KeepsEveryKey()
    with torch.no_grad():
        full, _ = model(ids)
        model(ids[:, :7], kv_cache=everything)
        cache = KVCache()
        cache.hold(everything.keys, everything.values)
        assert [cache.get_seq_length(layer) for layer in range(3)] == [7, 7, 7]
        pieces = [model(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(pieces, 1), full[:, 7:], rtol=0, atol=1e-5)
    assert [k.shape[2] for k in cache.keys] == [2, 0, 12]


def test_attend_refuses_a_cache_that_dropped_keys_a_query_still_sees():
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    attend(q, k, v, window=("sliding", 2), key_start=8)  # the query, token 9, sees 8 and itself
    with pytest.raises(ValueError, match="keys from token 7 on, but the cache holds them from token 8 only"):
        attend(q, k, v, window=("sliding", 3), key_start=8)  # it sees 7 as well
