import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from ropelab.cli import main
from ropelab.config import ConfigError
from ropelab.data.corpus import in_validation
from ropelab.data.prepare import prepare
from ropelab.data.sources import Source
from ropelab.data.tokenizer import ByteTokenizer
from ropelab.data.tokens import SPLITS, open_split
from ropelab.train.lock import RunLock
from tests.data.interrupt import interrupt_after_two_shards

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) + f" #{i} é" for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def decoded_documents(folder: Path, split: str) -> list[str]:
    data = open_split(folder, split)
    out = []
    for shard in data.shards:
        for a, b in zip(shard.doc_offsets[:-1], shard.doc_offsets[1:]):
            ids = shard.tokens[a:b]
            assert ids[-1] == ByteTokenizer.eos_id
            out.append(bytes(ids[:-1].astype(np.uint8)).decode("utf-8"))
    return out


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, list[str]]:
    docs = texts(120)
    rows = [{"text": t, "id": i} for i, t in enumerate(docs)]
    rows[5]["text"], rows[9]["text"] = "", None  # empty and missing documents are skipped
    return write_jsonl(tmp_path / "docs.jsonl", rows), [t for i, t in enumerate(docs) if i not in (5, 9)]


def test_jsonl_to_shards_round_trip(tmp_path, corpus):
    path, docs = corpus
    manifest = prepare(Source(str(path)), ByteTokenizer(), tmp_path / "out", val_percent=20, shard_tokens=800, workers=1, progress=False)
    expected = {"validation": [t for t in docs if in_validation(t, 20)]}
    expected["train"] = [t for t in docs if not in_validation(t, 20)]
    for split in SPLITS:
        assert decoded_documents(tmp_path / "out", split) == expected[split]
        info = manifest["splits"][split]
        assert info["documents"] == len(expected[split])
        assert info["tokens"] == sum(len(t.encode()) + 1 for t in expected[split])
    assert len(manifest["splits"]["train"]["shards"]) > 3 and manifest["dtype"] == "uint16"
    assert manifest["empty_documents"] == 2 and manifest["documents_read"] == 120
    assert manifest["splits"]["train"]["max_token_id"] == ByteTokenizer.eos_id
    assert not (tmp_path / "out" / "progress.json").exists()


def test_output_does_not_depend_on_worker_count(tmp_path, corpus):
    path, _ = corpus
    for workers in (1, 2):
        prepare(Source(str(path)), ByteTokenizer(), tmp_path / f"w{workers}", val_percent=20, shard_tokens=700, workers=workers, progress=False)
    assert folder_bytes(tmp_path / "w1") == folder_bytes(tmp_path / "w2")


def test_interrupted_preparation_resumes_to_identical_bytes(tmp_path, corpus, monkeypatch):
    path, _ = corpus
    settings = dict(val_percent=20, shard_tokens=500, workers=1, progress=False)
    prepare(Source(str(path)), ByteTokenizer(), tmp_path / "whole", **settings)

    interrupt_after_two_shards(monkeypatch, lambda: prepare(Source(str(path)), ByteTokenizer(), tmp_path / "cut", **settings))
    progress = json.loads((tmp_path / "cut" / "progress.json").read_text())
    kept = [r["name"] for records in progress["splits"].values() for r in records]
    assert len(kept) == 2 and not (tmp_path / "cut" / "manifest.json").exists()
    inodes = {name: os.stat(tmp_path / "cut" / f"{name}.bin").st_ino for name in kept}

    with pytest.raises(ConfigError, match="other settings"):
        prepare(Source(str(path)), ByteTokenizer(), tmp_path / "cut", **(settings | {"val_percent": 10}))
    prepare(Source(str(path)), ByteTokenizer(), tmp_path / "cut", **settings)
    assert folder_bytes(tmp_path / "cut") == folder_bytes(tmp_path / "whole")
    assert inodes == {name: os.stat(tmp_path / "cut" / f"{name}.bin").st_ino for name in kept}  # not rewritten


def test_parquet_text_field_and_limits(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = texts(60, seed=1)
    pq.write_table(pa.table({"content": docs, "n": list(range(60))}), tmp_path / "docs.parquet")
    source = Source(str(tmp_path / "docs.parquet"), text_field="content")
    manifest = prepare(source, ByteTokenizer(), tmp_path / "a", val_percent=25, max_documents=40, workers=1, progress=False)
    assert manifest["documents_read"] == 40
    assert sorted(decoded_documents(tmp_path / "a", "train") + decoded_documents(tmp_path / "a", "validation")) == sorted(docs[:40])
    manifest = prepare(source, ByteTokenizer(), tmp_path / "b", val_percent=40, max_tokens=2000, workers=1, progress=False)
    lengths = [len(t.encode()) + 1 for t in docs]
    stop = int(np.searchsorted(np.cumsum(lengths), 2000)) + 1  # the document that reaches the limit is the last
    assert manifest["documents_read"] == stop


def test_txt_folder_is_one_document_per_file_and_bos_is_optional(tmp_path):
    (tmp_path / "txt" / "sub").mkdir(parents=True)
    docs = texts(12, seed=2)
    for i, t in enumerate(docs):
        (tmp_path / "txt" / ("sub" if i % 2 else "") / f"{i:02d}.txt").write_text(t + "\nsecond line\n")
    manifest = prepare(Source(str(tmp_path / "txt")), ByteTokenizer(), tmp_path / "out", val_percent=30, bos=True, workers=1, progress=False)
    assert manifest["documents_read"] == 12 and manifest["source"]["files"] == 12
    split = open_split(tmp_path / "out", "train")
    first = split.shards[0].tokens[: split.shards[0].doc_offsets[1]]
    assert first[0] == ByteTokenizer.bos_id and first[-1] == ByteTokenizer.eos_id
    assert bytes(first[1:-1].astype(np.uint8)).decode().endswith("\nsecond line\n")


# ------------------------------------------------------------------------- bad input


def test_missing_file_and_unsupported_type(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        Source(str(tmp_path / "nope.jsonl"))
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(ConfigError, match="unsupported file type"):
        Source(str(tmp_path / "a.csv"))


def test_missing_text_field_names_the_field(tmp_path, corpus):
    path, _ = corpus
    with pytest.raises(ConfigError, match=r"no text field 'body'; fields are text, id") as err:
        prepare(Source(str(path), text_field="body"), ByteTokenizer(), tmp_path / "out", workers=1, progress=False)
    assert "\n" not in str(err.value)


def test_non_text_field_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine", "n": 3}])
    with pytest.raises(ConfigError, match="field 'n' of document 0 is int, not text"):
        prepare(Source(str(path), text_field="n"), ByteTokenizer(), tmp_path / "out", workers=1, progress=False)


def test_undecodable_bytes_name_the_file(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("good text")
    (folder / "b.txt").write_bytes(b"bad \xff\xfe text")
    with pytest.raises(ConfigError, match=r"b\.txt: not valid UTF-8 .*--encoding-errors replace"):
        prepare(Source(str(folder)), ByteTokenizer(), tmp_path / "out", val_percent=40, workers=1, progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()
    manifest = prepare(Source(str(folder), encoding_errors="replace"), ByteTokenizer(), tmp_path / "ok", val_percent=40, workers=1, progress=False)
    assert manifest["documents_read"] == 2


def test_no_documents_in_a_split_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": " "}, {"text": ""}, {"text": "only one"}])
    with pytest.raises(ConfigError, match="got no documents"):
        prepare(Source(str(path)), ByteTokenizer(), tmp_path / "out", workers=1, progress=False)


def test_existing_folders_are_never_overwritten(tmp_path, corpus):
    path, _ = corpus
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        prepare(Source(str(path)), ByteTokenizer(), other, workers=1, progress=False)
    assert [p.name for p in other.iterdir()] == ["keep.txt"]

    done = tmp_path / "done"
    first = prepare(Source(str(path)), ByteTokenizer(), done, val_percent=20, workers=1, progress=False)
    before = folder_bytes(done)
    assert prepare(Source(str(path)), ByteTokenizer(), done, val_percent=20, workers=1, progress=False) == first
    with pytest.raises(ConfigError, match="already holds data prepared with other settings"):
        prepare(Source(str(path)), ByteTokenizer(), done, val_percent=10, workers=1, progress=False)
    assert folder_bytes(done) == before


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("what", ["a run", "a run's lock alone", "shards without a preparation"])
def test_a_run_folder_or_any_folder_not_its_own_preparation_is_refused(what, run, tmp_path, corpus, capsys):
    path, _ = corpus
    out = tmp_path / "out"
    trainer = RunLock(out)
    if what == "a run":
        shutil.copytree(run, out, symlinks=True)
    elif what == "a run's lock alone":  # a trainer that has just started: its lock records its holder
        trainer.acquire()
    else:
        out.mkdir()
        (out / "train-00000.bin").write_bytes(b"not ours")
    before = contents(out)
    assert before
    code = main(["data", "prepare", "--source", str(path), "--tokenizer", "bytes", "--out", str(out), "--workers", "1",
                 "--no-progress"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1, err
    named = "not empty and holds no preparation" if what == "shards without a preparation" else "a run folder"
    assert err[0].startswith(f"ropelab: error: --out {out}: {named}") and "nothing was written" in err[0]
    assert contents(out) == before
    with pytest.raises(ConfigError, match=named):  # the library refuses it too
        prepare(Source(str(path)), ByteTokenizer(), out, workers=1, progress=False)
    assert contents(out) == before
    trainer.release()


def test_hub_offline_and_unreachable_fail_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        next(Source("HuggingFaceFW/fineweb", "sample-100BT").documents())
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for var in ("HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"cannot reach 127\.0\.0\.1:9") as err:
        next(Source("HuggingFaceFW/fineweb-edu").documents())
    assert time.perf_counter() - started < 30 and "\n" not in str(err.value)


def test_dataset_path_reads_a_local_dataset_repository(tmp_path):
    """The hub code path (datasets.load_dataset(name, config, split=...)) on a repository folder."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    docs = texts(30, seed=3)
    write_jsonl(repo / "data" / "train.jsonl", [{"text": t} for t in docs[:20]])
    write_jsonl(repo / "data" / "test.jsonl", [{"text": t} for t in docs[20:]])
    source = Source(f"hf:{repo}", split="test")
    assert source.describe() == {"kind": "dataset", "name": str(repo), "config": None, "split": "test", "text_field": "text"}
    assert [text for _, text in source.documents()] == docs[20:]
    assert [text for _, text in source.documents(skip=7)] == docs[27:]


def test_cli_prepare_and_verify(tmp_path, corpus, capsys):
    path, _ = corpus
    out = tmp_path / "out"
    assert main(["data", "prepare", "--source", str(path), "--tokenizer", "bytes", "--out", str(out), "--val-percent", "20",
                 "--shard-tokens", "1000", "--workers", "1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"data.corpus={out}" in printed and "train:" in printed
    assert main(["data", "verify", str(out), "--no-progress"]) == 0
    shard = out / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["data", "verify", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ropelab: error: {shard}: sha256 differs") and "\n" not in err
    assert main(["data", "prepare", "--source", str(tmp_path / "missing.jsonl"), "--tokenizer", "bytes", "--out", str(tmp_path / "x")]) == 2
