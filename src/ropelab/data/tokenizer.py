"""Tokenizers behind one small interface: bytes, a byte-level BPE trained here, or any HF tokenizer.

Spec strings (``data.tokenizer``):
  * ``bytes``          – 256 byte values plus <eos>, <bos>, <pad>;
  * ``bpe:<vocab>``    – byte-level BPE trained with HF `tokenizers` on the training split of
                         the built-in corpus, cached under ``$ROPELAB_CACHE`` keyed by corpus and vocab;
  * a built-in model   – the tokenizer of a built-in model source such as ``smollm2-135m``
                         (`ropelab.sources.gguf_files.BUILTIN_SOURCES`), read from its GGUF file once and
                         cached under ``$ROPELAB_CACHE``: students that share the model's tokenizer;
  * anything else      – an HF tokenizer: a ``tokenizer.json`` file, a local folder, or a hub
                         name (loaded with `transformers.AutoTokenizer`; code shipped with it runs
                         only when the caller passes ``trust_remote_code=True``).
When the corpus is a prepared token folder made with the same spec, the copy saved in that
folder is used, so a run always tokenizes the way its data was tokenized.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Optional, Protocol

from ropelab.config import ConfigError
from ropelab.data.sources import BUILTIN_CORPORA, TEXT_CORPORA, corpus_documents, corpus_key
from ropelab.data.tokens import read_manifest
from ropelab.errors import load_failure


def cache_dir() -> Path:
    root = Path(os.environ.get("ROPELAB_CACHE", Path.home() / ".cache" / "ropelab"))
    root.mkdir(parents=True, exist_ok=True)
    return root


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    bos_id: Optional[int]
    pad_id: Optional[int]

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    name = "bytes"
    vocab_size = 259
    eos_id, bos_id, pad_id = 256, 257, 258

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "bytes-v1"

    def to_tokenizers(self):
        """This tokenizer as a `tokenizers.Tokenizer` (what transformers and lm-eval load): ids 0-255 are
        the bytes, `SPECIAL_TOKENS` take eos/bos/pad's ids 256-258. Byte-level BPE with no merges over the
        whole text (no regex split), so every UTF-8 byte is one token. Special tokens written in a text
        are encoded as their bytes too (`encode_special_tokens`; tokenizer.json does not store it), and
        `decode` drops them, as here."""
        from tokenizers import AddedToken, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

        tok = RustTokenizer(models.BPE(vocab={char: b for b, char in enumerate(_byte_level_chars())}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
        tok.encode_special_tokens = True
        return tok


def _byte_level_chars() -> list[str]:
    """The character byte-level tokenizers (GPT-2's `bytes_to_unicode`) stand for each byte, in byte
    order: printable Latin-1 bytes themselves, the others U+0100 onwards."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _fingerprint(rust_tokenizer) -> str:
    return hashlib.sha256(rust_tokenizer.to_str().encode()).hexdigest()[:16]


class HFTokenizer:
    """Wraps a `tokenizers.Tokenizer` (fast, Rust) with EOS/BOS/PAD ids resolved."""

    def __init__(self, tokenizer, name: str, eos: Optional[str] = None):
        self.tok = tokenizer
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find(eos, "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
        if self.eos_id is None:
            raise ConfigError(f"data.tokenizer={name!r}: no end-of-text token found in its vocabulary")
        self.bos_id = self._find(None, "<|bos|>", "<s>", "<bos>", "<|begin_of_text|>")
        self.pad_id = self._find(None, "<|pad|>", "<pad>", "[PAD]")

    def _find(self, first: Optional[str], *candidates: str) -> Optional[int]:
        for token in (first, *candidates):
            if token is not None and self.tok.token_to_id(token) is not None:
                return self.tok.token_to_id(token)
        return None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets nobody here reads
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    def fingerprint(self) -> str:
        return _fingerprint(self.tok)

    def save(self, path: Path) -> None:
        self.tok.save(str(path))


SPECIAL_TOKENS = ["<|endoftext|>", "<|bos|>", "<|pad|>"]


def train_bpe(texts: Iterable[str], vocab_size: int):
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_bpe(vocab_size: int, corpus: str, val_percent: float) -> HFTokenizer:
    """The BPE trained on `corpus`'s training split, from cache or trained now (seconds on stdlib)."""
    from tokenizers import Tokenizer as RustTokenizer

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(f"data.tokenizer=bpe:{vocab_size}: vocabulary must be at least {256 + len(SPECIAL_TOKENS)}")
    path = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{corpus_key(corpus, val_percent)}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tok = train_bpe(corpus_documents(corpus, "train", val_percent), vocab_size)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)
    return HFTokenizer(RustTokenizer.from_file(str(path)), f"bpe:{vocab_size}")


def load_hf_tokenizer(spec: str, trust_remote_code: bool = False) -> HFTokenizer:
    """A tokenizer.json file, a folder holding one, or an HF hub name (through transformers, which runs
    Python code shipped with the tokenizer only with `trust_remote_code`)."""
    from tokenizers import Tokenizer as RustTokenizer

    path = Path(spec)
    if path.is_file():
        return HFTokenizer(RustTokenizer.from_file(str(path)), spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(RustTokenizer.from_file(str(path / "tokenizer.json")), spec)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"data.tokenizer={spec!r}: not a local file; loading hub tokenizers needs `pip install ropelab[hf]`") from None
    try:
        hf = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except Exception as exc:  # network, missing repo, bad folder: one line for the user
        raise ConfigError(f"data.tokenizer={spec!r}: could not load ({load_failure(exc, trust_remote_code, 200)})") from None
    if not getattr(hf, "is_fast", False):
        raise ConfigError(f"data.tokenizer={spec!r}: only fast (tokenizers-backed) tokenizers are supported")
    return HFTokenizer(hf.backend_tokenizer, spec, eos=hf.eos_token)


def builtin_model_tokenizer(name: str) -> Optional[HFTokenizer]:
    """The tokenizer of built-in model source `name` (None for another name): its GGUF file's token
    table, saved as tokenizer.json under the cache (keyed by the file's path, size and modification
    time) on first use, so later loads need neither transformers nor the GGUF file's header."""
    from tokenizers import Tokenizer as RustTokenizer

    from ropelab.sources.gguf import load_gguf_tokenizer
    from ropelab.sources.gguf_files import BUILTIN_SOURCES, builtin_gguf

    if name not in BUILTIN_SOURCES:
        return None
    gguf = builtin_gguf(name)
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    path = cache_dir() / "tokenizers" / f"{name}-{key}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        load_gguf_tokenizer(gguf).backend_tokenizer.save(str(tmp))
        os.replace(tmp, path)
    return HFTokenizer(RustTokenizer.from_file(str(path)), name)


def tokenizer_file_fingerprint(path: Path) -> str:
    """The fingerprint `HFTokenizer.fingerprint` gives the tokenizer saved at `path`."""
    from tokenizers import Tokenizer as RustTokenizer

    return _fingerprint(RustTokenizer.from_file(str(path)))


def prepared_folder_tokenizer(spec: str, corpus: str) -> Optional[Tokenizer]:
    """The tokenizer saved in prepared token folder `corpus`, if it was made with `spec`."""
    folder = Path(corpus)
    if corpus in BUILTIN_CORPORA or not (folder / "manifest.json").is_file():
        return None
    manifest = read_manifest(folder)
    if manifest["tokenizer"] != spec or spec == "bytes":
        return None
    from tokenizers import Tokenizer as RustTokenizer

    tok = RustTokenizer.from_file(str(folder / "tokenizer.json"))
    return HFTokenizer(tok, spec, eos=tok.id_to_token(manifest["eos_id"]))


def load_tokenizer(spec: str, corpus: str = "stdlib", val_percent: float = 2.0, trust_remote_code: bool = False) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    saved = prepared_folder_tokenizer(spec, corpus)
    if saved is not None:
        return saved
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"data.tokenizer={spec!r}: expected bpe:<vocab size>, e.g. bpe:4096") from None
        return load_bpe(vocab, corpus if corpus in TEXT_CORPORA else "stdlib", val_percent)
    return builtin_model_tokenizer(spec) or load_hf_tokenizer(spec, trust_remote_code)


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    return -(-vocab_size // multiple) * multiple
