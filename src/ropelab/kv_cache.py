"""The key/value cache of generation: per layer, the rotated keys and values that later queries may still see.

Shapes: B batch, K key/value heads, D head_dim; per layer, S tokens seen before a forward, T in it,
and the last L of those S held.

A layer's window (`ropelab.attention_windows`) says which keys a query sees. Once a forward ends
with S tokens seen, the next query is token S, and every later query sees only keys from
`first_key(window, S)` on, so the cache holds those and drops the rest:
  * full attention: every token;
  * ``("sliding", W)``: the last W - 1 tokens (all of them while S < W);
  * ``("chunked", C)``: the tokens of the current chunk, S // C * C .. S - 1 (none right after a
    chunk's last token).
A windowed layer's memory is then bounded by its window whatever the generated length, as in
transformers' sliding-window caches. Attention learns where the held keys start from how many
tokens the layer has seen (`get_seq_length`, counting dropped ones too) and how many keys it gets.
"""

from __future__ import annotations

from typing import Optional

import torch

from ropelab.attention_windows import first_key


class KVCache:
    """Per layer, the rotated keys and values of the tokens that later queries may still see, and the
    number of tokens seen. Generation passes one to each forward, the prompt first, then the new
    tokens. transformers' Cache classes (DynamicCache) have the same two methods and serve as well
    (a DynamicCache holds every token)."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []  # per layer (B, K, L, D)
        self.values: list[torch.Tensor] = []
        self.seen: list[int] = []  # per layer: S, the tokens seen so far, dropped ones too

    def hold(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Hold, per layer, the keys and values (B, K, S, D) of every token seen so far (a prompt whose
        keys were computed elsewhere); the first `update` drops those no later query sees."""
        self.keys, self.values = list(keys), list(values)
        self.seen = [k.shape[2] for k in self.keys]

    def get_seq_length(self, layer: int = 0) -> int:
        """Tokens `layer` has seen so far (not the fewer it may hold): the position of the next one."""
        return self.seen[layer] if layer < len(self.seen) else 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int,
               cache_kwargs: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's key and value (B, K, T, D) of `layer`; returns the held ones and these,
        (B, K, L + T, D), the last L + T of the S + T tokens seen. Then keeps only those that queries
        after these T may see, by `cache_kwargs["window"]` (the layer's `Attention.window`; none: all)."""
        if layer == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
            self.seen.append(0)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], key], dim=2)
            self.values[layer] = torch.cat([self.values[layer], value], dim=2)
        keys, values = self.keys[layer], self.values[layer]
        self.seen[layer] += key.shape[2]
        seen = self.seen[layer]
        drop = first_key((cache_kwargs or {}).get("window"), seen) - (seen - keys.shape[2])  # held keys no later query sees
        if drop > 0:  # copies, so that the dropped keys' memory is freed
            self.keys[layer] = keys[:, :, drop:].clone()
            self.values[layer] = values[:, :, drop:].clone()
        return keys, values
