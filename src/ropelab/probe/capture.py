"""Capture the analysis positions of every stage of one forward pass, streamed to disk.

The model runs its own forward over the whole window once (it needs the full context); forward
hooks on its modules pick out the analysis positions the moment each activation exists and
append them to a safetensors file being written, so what the probe holds beyond the model's
own forward activations is a few rows per stage. Nothing of the model's code is copied: hooks
sit on

  * ``embed``                 token embeddings            (R, C)
  * ``blocks[i].attn.q_norm`` queries before RoPE, per head (R, H, D)  (nn.Identity without QK-norm)
  * ``blocks[i].attn.k_norm`` keys before RoPE             (R, K, D)
  * the layer's ``rope``      queries and keys after RoPE  (R, H, D), (R, K, D)
  * ``blocks[i]``             the block's output           (R, C)
  * ``final_norm``            final hidden state           (R, C)
R is the number of repeats. One `RotaryEmbedding` serves every layer with equal settings, so a
pre-hook on each layer's attention records which layer is calling it. The logits are the LM
head applied to the captured final hidden states: the same numbers as the model's logits at
those positions, without the (window x vocabulary) tensor of all of them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable, Optional

import torch

from ropelab.model import Transformer
from ropelab.probe.config import ProbeMode
from ropelab.probe.sequence import ProbeInput


class SafetensorsStream:
    """A safetensors file written one tensor at a time (float32).

    `add` appends a tensor's bytes to a spool file next to `path` and forgets the tensor;
    `finish` writes the header, copies the spool behind it under a temporary name and renames
    it to `path`. An aborted stream leaves no file at `path`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.spool_path = self.path.with_name(f".{self.path.name}.spool{os.getpid()}")
        self.spool = open(self.spool_path, "wb")
        self.entries: dict[str, dict] = {}
        self.offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"{name}: captured twice")
        array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
        self.spool.write(array.data)
        end = self.offset + array.nbytes
        self.entries[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [self.offset, end]}
        self.offset = end

    def finish(self, metadata: Optional[dict[str, str]] = None) -> Path:
        self.spool.close()
        header = json.dumps({"__metadata__": metadata or {}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # align the data to 8 bytes, as the reference writer does
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as out, open(self.spool_path, "rb") as spool:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(spool, out, 1 << 20)
        os.replace(tmp, self.path)
        self.spool_path.unlink()
        return self.path

    def abort(self) -> None:
        self.spool.close()
        self.spool_path.unlink(missing_ok=True)

    def __enter__(self) -> "SafetensorsStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def capture_name(stage: str, layer: Optional[int] = None) -> str:
    return stage if layer is None else f"{stage}.{layer}"


def capture(
    model: Transformer,
    probe: ProbeInput,
    mode: ProbeMode,
    layers: tuple[int, ...],
    stages: tuple[str, ...],
    stream: SafetensorsStream,
    on_layer: Optional[Callable[[], None]] = None,
) -> None:
    """Run `probe` through `model` as `mode` says and add the analysis rows of `stages` (for the
    `layers` given) to `stream`. The model must already be on its device and in the mode's dtype."""
    device = next(model.parameters()).device
    ids = probe.input_ids().to(device).unsqueeze(0)
    position_ids = probe.position_ids(mode.positions).to(device).unsqueeze(0)
    doc_ids = probe.doc_ids().to(device).unsqueeze(0) if mode.attention == "doc" else None
    rows = probe.analysis_positions().to(device)
    selected = set(layers)
    current = {"layer": -1}
    final_rows: list[torch.Tensor] = []
    handles = []

    def keep_tokens(name: str, token_dim: int) -> Callable:
        def hook(_module, _inputs, output):
            stream.add(name, output.index_select(token_dim, rows)[0])

        return hook

    def on_attention(layer: int) -> Callable:
        def pre_hook(_module, _inputs):
            current["layer"] = layer

        return pre_hook

    def on_rope(_module, _inputs, output):
        layer = current["layer"]
        if layer in selected:
            for stage, x in zip(("q_post", "k_post"), output):  # x (B, heads, T, D)
                if stage in stages:
                    stream.add(capture_name(stage, layer), x.index_select(2, rows)[0].transpose(0, 1))

    def on_final(_module, _inputs, output):
        final_rows.append(output.index_select(1, rows)[0])
        if "final" in stages:
            stream.add("final", final_rows[0])

    def on_block(_module, _inputs, _output):
        on_layer()

    try:
        if "embed" in stages:
            handles.append(model.embed.register_forward_hook(keep_tokens("embed", 1)))
        for layer, block in enumerate(model.blocks):
            handles.append(block.attn.register_forward_pre_hook(on_attention(layer)))
            if layer in selected:
                for stage, module in (("q_pre", block.attn.q_norm), ("k_pre", block.attn.k_norm), ("block", block)):
                    if stage in stages:
                        handles.append(module.register_forward_hook(keep_tokens(capture_name(stage, layer), 1)))
            if on_layer is not None:
                handles.append(block.register_forward_hook(on_block))
        handles += [rope.register_forward_hook(on_rope) for rope in model.ropes]
        handles.append(model.final_norm.register_forward_hook(on_final))
        backend = model.blocks[0].attn.backend
        if doc_ids is not None:
            model.set_attention_backend("varlen")  # cost of attention: sum of squared repeat lengths
        try:
            with torch.inference_mode():
                model.hidden_states(ids, position_ids, doc_ids)
                if "logits" in stages:
                    stream.add("logits", model.lm_head(final_rows[0]))
        finally:
            model.set_attention_backend(backend)
    finally:
        for handle in handles:
            handle.remove()
