"""Fault injection on token folders and preparations: every fault is one line naming the file, and
nothing already written is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ropelab.cli import main
from ropelab.config import ConfigError
from ropelab.data.loader import PackedLoader
from ropelab.data.pipeline import open_token_folder
from ropelab.data.prepare import prepare
from ropelab.data.sources import Source
from ropelab.data.tokenizer import ByteTokenizer
from ropelab.data.tokens import open_split
from tests.data.interrupt import interrupt_after_two_shards

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def texts(n: int, seed: int = 0, words: int = 40) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, words)))) + f" #{i}" for i in range(n)]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return path


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def prepared(tmp_path) -> Path:
    source = write_jsonl(tmp_path / "docs.jsonl", texts(150))
    prepare(Source(str(source)), ByteTokenizer(), tmp_path / "tokens", val_percent=20, shard_tokens=2000, workers=1, progress=False)
    return tmp_path / "tokens"


def rewrite_keeping_mtime(path: Path, edit) -> None:
    """Change a file's bytes in place (same inode and size) and put its modification time back."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    edit(data)
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_size == stat.st_size


def verify(folder: Path, capsys) -> tuple[int, str]:
    code = main(["data", "verify", str(folder), "--no-progress"])
    return code, capsys.readouterr().err.strip()


# ------------------------------------------------------------------ verify hashes the bytes


def test_verify_hashes_a_shard_changed_with_its_mtime_kept(prepared, capsys):
    assert verify(prepared, capsys) == (0, "")
    open_token_folder(prepared, "once")  # the successful check is recorded: training's start skips hashing
    shard = prepared / "train-00001.bin"
    rewrite_keeping_mtime(shard, lambda data: data.__setitem__(10, data[10] ^ 1))

    code, err = verify(prepared, capsys)
    assert code == 2 and err == f"ropelab: error: {shard}: sha256 differs from {prepared / 'manifest.json'}; the shard is damaged or was replaced"
    with pytest.raises(ConfigError, match="sha256 differs"):  # the record no longer stands: its change time moved
        open_token_folder(prepared, "once")


# ------------------------------------------------------------------ token ids above the vocabulary


def plant_out_of_range_ids(shard: Path, token_id: int, every: int) -> None:
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[::every] = token_id
    ids.tofile(shard)


def test_out_of_range_id_is_named_by_verify(prepared, capsys):
    shard = prepared / "train-00002.bin"
    plant_out_of_range_ids(shard, 1000, 500)
    code, err = verify(prepared, capsys)
    assert code == 2 and "\n" not in err
    assert err.startswith(f"ropelab: error: {shard}: holds token id 1000, above the largest id written into it (256; the tokenizer has 259)")


def test_out_of_range_id_stops_training_in_one_line_under_verify_sizes(tmp_path, tiny_overrides, capsys):
    source = write_jsonl(tmp_path / "docs.jsonl", texts(80, seed=1))
    folder = tmp_path / "tokens"
    prepare(Source(str(source)), ByteTokenizer(), folder, val_percent=20, workers=1, progress=False)  # one shard per split
    shard = folder / "train-00000.bin"
    plant_out_of_range_ids(shard, 1000, 16)  # beyond the model's 320 rows: an IndexError in the embedding unguarded

    with pytest.raises(ConfigError, match=rf"{shard}: holds token id 1000, above the largest id written into it \(256\)"):
        PackedLoader(open_split(folder, "train"), 32).batch(0, 0, 4, 1)
    code = main(["train", "--out", str(tmp_path / "run"), *tiny_overrides, f"data.corpus={folder}", "data.verify=sizes",
                 "train.steps=1", "train.eval_every=1", "train.checkpoint_every=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith(f"ropelab: error: {shard}: holds token id 1000")


# ------------------------------------------------------------------ damaged index under data.verify=sizes


@pytest.mark.parametrize("damage", ["magic", "header"])
def test_damaged_index_header_is_one_line_under_verify_sizes(prepared, damage):
    index = prepared / "validation-00000.idx.npy"
    if damage == "magic":
        rewrite_keeping_mtime(index, lambda data: data.__setitem__(slice(0, 6), b"NOTNPY"))
    else:
        rewrite_keeping_mtime(index, lambda data: data.__setitem__(slice(10, 20), b"<<garbage>"))
    manifest = open_token_folder(prepared, "sizes")
    with pytest.raises(ConfigError, match=rf"^{index}: not a readable document index \(.*\); the shard is damaged") as err:
        open_split(prepared, "validation", manifest)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ a resume after the source changed


def test_resume_is_refused_when_a_source_file_changed(tmp_path, monkeypatch):
    folder = tmp_path / "src"
    folder.mkdir()
    docs = texts(90, seed=2)
    for i in range(3):
        write_jsonl(folder / f"part{i}.jsonl", docs[i * 30:(i + 1) * 30])
    out = tmp_path / "out"
    settings = dict(val_percent=20, shard_tokens=500, workers=1, progress=False)
    run = lambda: prepare(Source(str(folder)), ByteTokenizer(), out, **settings)  # noqa: E731
    interrupt_after_two_shards(monkeypatch, run)
    kept = folder_bytes(out)
    part = folder / "part1.jsonl"
    original, stat = part.read_bytes(), part.stat()

    part.write_bytes(original.replace(b"alpha", b"ALPHA"))  # same size, new text
    with pytest.raises(ConfigError, match=rf"^--source {folder}: {part} was modified since the unfinished preparation"):
        run()
    part.write_bytes(original + original[:40])
    with pytest.raises(ConfigError, match=rf"{part} changed size \({stat.st_size} -> {stat.st_size + 40} bytes\)"):
        run()
    part.write_bytes(original)
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (folder / "part3.jsonl").write_text(json.dumps({"text": "new"}) + "\n")
    with pytest.raises(ConfigError, match=rf"{folder / 'part3.jsonl'} was added since"):
        run()
    assert folder_bytes(out) == kept  # refusals write nothing

    (folder / "part3.jsonl").unlink()
    manifest = run()  # the source as it was: the preparation resumes
    assert manifest["documents_read"] == 90


# ------------------------------------------------------------------ SIGTERM and SIGINT with worker processes


def test_a_pool_ended_right_after_it_started_leaves_no_worker_behind(tmp_path):
    """`prepare` handles SIGTERM while its pool runs. A worker forked with that handler, sent the pool's
    SIGTERM before resetting it, used to drop the signal and live on, the pool waiting for it forever:
    most runs of 40 tiny preparations hung. Workers now start with the signal blocked."""
    source = write_jsonl(tmp_path / "docs.jsonl", texts(20))

    def give_up(signum, frame):
        raise TimeoutError("a pool worker outlived the pool's terminate()")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(120)
    try:
        for i in range(40):
            prepare(Source(str(source)), ByteTokenizer(), tmp_path / f"out{i}", val_percent=40, workers=2, progress=False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class _LargeResults:
    """An encoder whose every result is 16 MiB, far more than a pipe holds (so a worker sends it for a
    while), each filled with its batch's number."""

    def __call__(self, batch):
        return [np.full(1 << 22, int(key), dtype=np.int32) for key, _ in batch]


def _large_batches(n: int, text: str = "text"):
    return iter([[(str(i), text)] for i in range(n)])


def test_workers_with_large_results_and_batches_deliver_every_batch_in_order():
    """The main process sends a batch to a worker that may be busy sending a result nobody reads yet: a
    thread in the worker takes batches in meanwhile, so neither side waits on the other."""
    import threading

    from ropelab.data.encoding import encoded_batches

    batches = _large_batches(10, "x" * (1 << 20))  # a 1 MiB batch is more than a pipe holds too
    got = []
    reader = threading.Thread(target=lambda: got.extend(int(result[0][0]) for result in
                                                        encoded_batches(_LargeResults(), batches, workers=2)),
                              daemon=True)
    reader.start()
    reader.join(120)  # a deadlock fails the test instead of hanging the suite
    assert not reader.is_alive(), "the main process and a worker waited on each other"
    assert got == list(range(10))


def test_workers_sending_large_results_are_ended_at_once_when_the_reader_stops():
    """What a Ctrl-C does to `encoded_batches`: the consumer stops while workers still compute or send
    large results. The workers must be gone within seconds, whatever they were doing. (With
    multiprocessing.Pool a data prepare hung here at random, in one of three test-suite runs and in the
    5th of 5 Ctrl-Cs under load: its terminate() can wait forever on the results queue's lock, held by
    a worker blocked in its send. This test shows the ending works; it does not force that race.)"""
    import multiprocessing
    import threading

    from ropelab.data.encoding import encoded_batches

    others = set(multiprocessing.active_children())  # whatever another test left running here
    batches = encoded_batches(_LargeResults(), _large_batches(12), workers=2)
    assert int(next(batches)[0][0]) == 0
    time.sleep(0.5)  # the other in-flight results are now being sent, with nobody reading them
    closer = threading.Thread(target=batches.close, daemon=True)
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "ending the workers hung"
    assert set(multiprocessing.active_children()) <= others


@pytest.fixture(scope="module")
def long_source(tmp_path_factory) -> tuple[Path, list[str]]:
    """Enough documents that `data prepare --workers 2` runs for seconds after its first shard."""
    docs = texts(5_000, seed=3, words=120)
    return write_jsonl(tmp_path_factory.mktemp("long") / "docs.jsonl", docs), docs


def recorded_shards(out: Path) -> int:
    try:
        return sum(len(r) for r in json.loads((out / "progress.json").read_text())["splits"].values())
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_prepare_with_workers_is_one_line_and_resumable(tmp_path, long_source, sig):
    source, docs = long_source
    out = tmp_path / "out"
    command = [sys.executable, "-m", "ropelab", "data", "prepare", "--source", str(source), "--tokenizer", "bytes",
               "--out", str(out), "--shard-tokens", "20000", "--workers", "2", "--no-progress"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while recorded_shards(out) < 1 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the preparation ended before it could be interrupted; use more documents"
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)  # stderr closes once the workers are gone too
    how = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted"
    assert err == f"ropelab: {how}; completed shards are kept in {out}: re-run the same command to resume\n"
    assert process.returncode == (75 if sig == signal.SIGTERM else 130)  # EX_TEMPFAIL: re-run to resume
    assert recorded_shards(out) >= 1 and not (out / "manifest.json").exists()

    assert main(command[3:-3] + ["--workers", "1", "--no-progress"]) == 0  # the same settings: resumes
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents_read"] == len(docs)
    assert sum(info["tokens"] for info in manifest["splits"].values()) == sum(len(t.encode()) + 1 for t in docs)
