"""The probe sequence: one block of real text (BOS, content, EOS) repeated to fill the window.

Every repeat holds the same tokens, so whatever differs between the repeats' hidden states
comes from position and from attention to the earlier repeats (the seed's construction,
Huber et al. 2026, Sec. 4). The analysed token of a repeat is the last content token, the one
right before its EOS: it has the most context within its own block.

The content is the first document of at least block_len - 2 tokens from the validation split
of the checkpoint's corpus, or the start of a text file the user gives. A tokenizer without a
BOS token (many HF ones) starts each block with EOS instead, as packed training windows do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from ropelab.config import ConfigError, RunConfig
from ropelab.data.sources import BUILTIN_CORPORA, corpus_documents
from ropelab.data.tokenizer import Tokenizer
from ropelab.data.tokens import open_split


@dataclass
class ProbeInput:
    content_ids: list[int]  # block_len - 2 tokens of text
    repeats: int
    bos_id: int
    eos_id: int
    text: str  # the content, decoded
    source: str  # where the content came from

    @property
    def block_len(self) -> int:
        return len(self.content_ids) + 2

    @property
    def window(self) -> int:
        return self.block_len * self.repeats

    @property
    def block_ids(self) -> list[int]:
        return [self.bos_id, *self.content_ids, self.eos_id]

    def input_ids(self) -> torch.Tensor:
        """(window,) long: the block, `repeats` times."""
        return torch.tensor(self.block_ids, dtype=torch.long).repeat(self.repeats)

    def analysis_positions(self) -> torch.Tensor:
        """(repeats,) long: index of the token right before each EOS."""
        return torch.arange(self.repeats) * self.block_len + self.block_len - 2

    def position_ids(self, positions: str) -> torch.Tensor:
        """(window,) long: 0..window-1 (``running``) or 0..block_len-1 in every repeat (``restart``)."""
        if positions == "running":
            return torch.arange(self.window)
        return torch.arange(self.block_len).repeat(self.repeats)

    def doc_ids(self) -> torch.Tensor:
        """(window,) long: the repeat each token belongs to (the document mask's documents)."""
        return torch.arange(self.repeats).repeat_interleave(self.block_len)

    def metadata(self) -> dict:
        return {
            "block_len": self.block_len, "repeats": self.repeats, "window": self.window,
            "bos_id": self.bos_id, "eos_id": self.eos_id, "source": self.source,
            "block_ids": self.block_ids, "analysis_positions": self.analysis_positions().tolist(),
            "analysis_position_in_block": self.block_len - 2, "text": self.text,
        }


def block_start_id(tokenizer: Tokenizer) -> int:
    return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id


def build_probe_input(
    tokenizer: Tokenizer, content_ids: list[int], block_len: int, repeats: int, source: str
) -> ProbeInput:
    need = block_len - 2
    if len(content_ids) < need:
        raise ConfigError(f"{source}: {len(content_ids)} tokens of text, fewer than the {need} a block of {block_len} needs")
    content = [int(i) for i in content_ids[:need]]
    return ProbeInput(content, repeats, block_start_id(tokenizer), tokenizer.eos_id, tokenizer.decode(content), source)


def _specials(tokenizer: Tokenizer) -> set[int]:
    return {i for i in (tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id) if i is not None}


def text_file_content(path: str | Path, tokenizer: Tokenizer) -> list[int]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--text {path}: no such file")
    text = path.read_text(encoding="utf-8", errors="replace")
    specials = _specials(tokenizer)
    return [i for i in tokenizer.encode_batch([text])[0] if i not in specials]


def _folder_documents(folder: Path) -> Iterator[list[int]]:
    """Token ids of every validation document of a prepared token folder, shard by shard."""
    for shard in open_split(folder, "validation").shards:
        offsets = shard.doc_offsets
        for d in range(len(offsets) - 1):
            yield shard.tokens[offsets[d] : offsets[d + 1]].tolist()


def validation_content(config: RunConfig, tokenizer: Tokenizer, need: int) -> tuple[list[int], str]:
    """(token ids, description) of the first validation document with at least `need` tokens
    (special tokens dropped)."""
    data = config.data
    specials = _specials(tokenizer)
    if data.corpus in BUILTIN_CORPORA:
        documents = (tokenizer.encode_batch([text])[0] for text in corpus_documents(data.corpus, "validation", data.val_percent))
    else:
        documents = _folder_documents(Path(data.corpus))
    for index, ids in enumerate(documents):
        ids = [i for i in ids if i not in specials]
        if len(ids) >= need:
            return ids, f"validation document {index} of corpus {data.corpus}"
    raise ConfigError(
        f"data.corpus={data.corpus!r}: no validation document has {need} tokens; pass --text FILE or a smaller --block-len"
    )


def probe_input_for(
    config: RunConfig, tokenizer: Tokenizer, block_len: int, repeats: int, text_file: Optional[str] = None
) -> ProbeInput:
    """The probe sequence for a checkpoint's run config: content from `text_file` or its validation split."""
    if text_file is not None:
        return build_probe_input(tokenizer, text_file_content(text_file, tokenizer), block_len, repeats, f"--text {text_file}")
    ids, source = validation_content(config, tokenizer, block_len - 2)
    return build_probe_input(tokenizer, ids, block_len, repeats, source)


def write_input(folder: Path, probe: ProbeInput) -> list[str]:
    """input.json (metadata, block ids, analysis positions, text), input_ids.npy (the whole
    window) and input.txt (the content text). Returns the file names."""
    (folder / "input.json").write_text(json.dumps(probe.metadata(), indent=2) + "\n")
    np.save(folder / "input_ids.npy", probe.input_ids().numpy())
    (folder / "input.txt").write_text(probe.text)
    return ["input.json", "input_ids.npy", "input.txt"]
