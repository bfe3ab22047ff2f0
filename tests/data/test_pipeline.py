import json
import os
import shutil

import numpy as np
import pytest

from ropelab.config import ConfigError, build_run_config
from ropelab.data import verify as verify_module
from ropelab.data.pipeline import build_loaders
from ropelab.data.prepare import prepare
from ropelab.data.sources import Source
from ropelab.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from ropelab.data.tokens import read_manifest

WORDS = "the of and to in is that for it as with was on be by this are from or at".split()


def write_docs(path, n=150, seed=0):
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 60)))) for _ in range(n)]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs}), path)
    else:
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


@pytest.fixture(scope="module")
def byte_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes")
    write_docs(root / "docs.jsonl")
    prepare(Source(str(root / "docs.jsonl")), ByteTokenizer(), root / "out", val_percent=20, shard_tokens=1500, workers=1, progress=False)
    return root / "out"


@pytest.fixture
def folder(byte_folder, tmp_path):
    """A private copy, free to damage."""
    return shutil.copytree(byte_folder, tmp_path / "data")


def config_for(folder, *extra):
    return build_run_config(overrides=[f"data.corpus={folder}", "data.tokenizer=bytes", "data.seq_len=16", *extra])


def test_loaders_read_the_folder(folder):
    train, val, manifest = build_loaders(config_for(folder, "data.pack=whole"))
    assert manifest["tokenizer"] == "bytes" and train.num_windows > val.num_windows > 0
    batch = train.batch(0, 0, 4, 1)
    assert batch.input_ids.shape == (4, 16) and (batch.input_ids[batch.labels == -100] >= 0).all()


def test_damaged_shard_is_caught_by_checksum_not_by_sizes(folder):
    shard = folder / "train-00002.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x01
    shard.write_bytes(bytes(data))
    build_loaders(config_for(folder, "data.verify=sizes"))
    for mode in ("always", "once"):  # the flipped bit may raise an id above the shard's largest: named first
        with pytest.raises(ConfigError, match=rf"{shard}: (sha256 differs|holds token id \d+, above)"):
            build_loaders(config_for(folder, f"data.verify={mode}"))


def test_truncated_shard_fails_the_size_check(folder):
    shard = folder / "validation-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=f"{shard}: .* bytes, the manifest says"):
        build_loaders(config_for(folder, "data.verify=sizes"))


def test_verify_once_hashes_until_a_file_changes(folder, monkeypatch):
    hashed = []
    real = verify_module.sha256_and_max
    monkeypatch.setattr(verify_module, "sha256_and_max", lambda p, dtype: hashed.append(p) or real(p, dtype))
    build_loaders(config_for(folder))
    first = len(hashed)
    build_loaders(config_for(folder))
    assert first > 0 and len(hashed) == first  # remembered
    shard = folder / "train-00000.bin"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    build_loaders(config_for(folder))
    assert len(hashed) == 2 * first


def test_other_tokenizer_is_refused(folder, tmp_path):
    train_bpe([" ".join(WORDS)] * 20, 300).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"differs from the tokenizer of .*; set data.tokenizer=bytes"):
        build_loaders(build_run_config(overrides=[f"data.corpus={folder}", f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.seq_len=16"]))


def test_token_ids_beyond_the_model_vocabulary_are_refused(folder):
    with pytest.raises(ConfigError, match=r"model.vocab_size=200: .* token ids up to 256"):
        build_loaders(config_for(folder, "model.vocab_size=200"))


def test_unfinished_folder_points_to_resume(folder):
    (folder / "manifest.json").rename(folder / "progress.json")
    with pytest.raises(ConfigError, match="re-run the same prepare command to resume"):
        build_loaders(config_for(folder))


def test_saved_tokenizer_is_used_and_checked(tmp_path):
    rust = train_bpe([" ".join(WORDS)] * 20, 300)
    rust.save(str(tmp_path / "tokenizer.json"))
    spec = str(tmp_path / "tokenizer.json")
    write_docs(tmp_path / "docs.jsonl", n=60)
    prepare(Source(str(tmp_path / "docs.jsonl")), load_tokenizer(spec), tmp_path / "data", val_percent=20, workers=1, progress=False)
    (tmp_path / "tokenizer.json").unlink()  # the run must not need the original any more
    saved = load_tokenizer(spec, str(tmp_path / "data"))
    assert isinstance(saved, HFTokenizer) and saved.fingerprint() == read_manifest(tmp_path / "data")["tokenizer_fingerprint"]
    config = build_run_config(overrides=[f"data.corpus={tmp_path / 'data'}", f"data.tokenizer={spec}", "data.seq_len=8"])
    build_loaders(config)
    tampered = json.loads((tmp_path / "data" / "tokenizer.json").read_text())
    tampered["added_tokens"][0]["content"] = "<|other|>"
    (tmp_path / "data" / "tokenizer.json").write_text(json.dumps(tampered))
    with pytest.raises(ConfigError, match="tokenizer fingerprint differs"):
        build_loaders(config)


def test_train_on_prepared_shards_with_document_masking_and_resume_exactly(tmp_path, tiny_overrides):
    from ropelab.train import checkpoint as ckpt
    from ropelab.train.loop import train
    from ropelab.train.metrics import read_metrics

    write_docs(tmp_path / "docs.jsonl", n=200)
    prepare(Source(str(tmp_path / "docs.jsonl")), ByteTokenizer(), tmp_path / "data", val_percent=10, shard_tokens=2000, workers=1, progress=False)
    overrides = tiny_overrides + [f"data.corpus={tmp_path / 'data'}", "attention.doc_mask=true", "data.pack=whole", "train.steps=6",
                                  "train.eval_every=3", "train.checkpoint_every=3", "data.positions=restart", "data.mask_boundary_labels=true"]
    losses = lambda run: [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run)]  # noqa: E731
    train(build_run_config(overrides=overrides), tmp_path / "full")
    part = tmp_path / "part"
    train(build_run_config(overrides=overrides), part)
    shutil.rmtree(ckpt.checkpoint_dir(part) / "step_00000006")
    (part / "result.json").unlink()
    train(out_dir=part, resume=True)
    rows = losses(part)
    assert rows == losses(tmp_path / "full") and len(rows) == 6 and rows[-1][2] is not None


def test_train_on_prepared_parquet(tmp_path, tiny_overrides):
    from ropelab.train.loop import train

    write_docs(tmp_path / "docs.parquet", n=120)
    prepare(Source(str(tmp_path / "docs.parquet")), ByteTokenizer(), tmp_path / "data", val_percent=10, workers=1, progress=False)
    overrides = tiny_overrides + [f"data.corpus={tmp_path / 'data'}", "attention.doc_mask=true", "train.steps=2", "train.eval_every=2"]
    result = train(build_run_config(overrides=overrides), tmp_path / "run")
    assert result.steps == 2 and np.isfinite(result.final_val_loss)
