"""`ropelab data prepare` and `ropelab data verify`."""

from __future__ import annotations

import argparse
import signal
import sys

from ropelab.cli.common import Command, command_group
from ropelab.files import writable_folder
from ropelab.train.stop import exit_code


def _add_data_prepare(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True,
                   help="stdlib, stdlib-prose, wiki-prose (-fr, -es) or shakespeare (built in); a .jsonl/.json/.parquet/.txt file or a folder of them "
                        "(a .txt file is one document); "
                        "or a Hugging Face dataset: owner/name or hf:NAME (streamed)")
    p.add_argument("--hf-config", help="dataset config (subset) name, e.g. sample-100BT")
    p.add_argument("--split", default="train", help="dataset split to read (default: train)")
    p.add_argument("--text-field", default="text", help="field holding the text in json/parquet/dataset rows (default: text)")
    p.add_argument("--tokenizer", required=True, help="bytes, bpe:<vocab> (trained on the built-in --source for wiki-prose and shakespeare, else on stdlib), a tokenizer.json, or an HF name, e.g. EleutherAI/pythia-1b")
    p.add_argument("--out", dest="out_dir", required=True, help="folder for the shards (new, or an unfinished one to resume)")
    p.add_argument("--val-percent", type=float, default=2.0, help="share of documents held out for validation, by a hash of their text (default 2)")
    p.add_argument("--max-documents", type=int, help="stop after this many source documents")
    p.add_argument("--max-tokens", type=int, help="stop once this many tokens are written (e.g. a 100BT subset's first 1B)")
    p.add_argument("--shard-tokens", type=int, default=2**28, help="tokens per shard (default 2^28)")
    p.add_argument("--bos", action="store_true", help="prepend BOS to every document (EOS is always appended)")
    p.add_argument("--encoding-errors", default="strict", choices=["strict", "replace", "ignore"], help="undecodable bytes in .txt/json files (default: strict = error)")
    p.add_argument("--workers", type=int, help="tokenizer processes (default: one per CPU core)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run Python code shipped with an HF tokenizer (off: such a tokenizer is refused)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from ropelab.data.prepare import preparation_folder, prepare
    from ropelab.data.sources import BUILTIN_CORPORA, Source
    from ropelab.data.tokenizer import load_tokenizer

    writable_folder(preparation_folder(args.out_dir))  # before the tokenizer, which may take long to train
    source = Source(args.source, args.hf_config, args.split, args.text_field, args.encoding_errors)
    tokenizer = load_tokenizer(args.tokenizer, args.source if args.source in BUILTIN_CORPORA else "stdlib",
                               trust_remote_code=args.trust_remote_code)
    try:
        manifest = prepare(source, tokenizer, args.out_dir, val_percent=args.val_percent, max_documents=args.max_documents,
                           max_tokens=args.max_tokens, shard_tokens=args.shard_tokens, bos=args.bos, workers=args.workers,
                           progress=not args.no_progress)
    except KeyboardInterrupt as stop:  # SIGINT, or SIGTERM (`prepare` raises it with the signal's name)
        terminated = stop.args == ("SIGTERM",)
        how = "stopped by SIGTERM" if terminated else "interrupted"
        print(f"ropelab: {how}; completed shards are kept in {args.out_dir}: re-run the same command to resume", file=sys.stderr)
        return exit_code(signal.SIGTERM if terminated else signal.SIGINT)  # 75 or 130, as train and study
    if "licence" in manifest["source"]:
        source = manifest["source"]
        print(f"text: {source['text']} ({source['language']}), from the package {source['package']}; licence {source['licence']}")
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens in {len(info['shards'])} shard(s)")
    print(f"tokenizer {manifest['tokenizer']} ({manifest['vocab_size']:,} tokens, {manifest['dtype']}) -> {args.out_dir}")
    print(f"train on it with: ropelab train data.corpus={args.out_dir} data.tokenizer={manifest['tokenizer']}")
    return 0


def _add_data_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="a folder written by `ropelab data prepare`")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def cmd_data_verify(args: argparse.Namespace) -> int:
    from ropelab.data.tokens import check_sizes, read_manifest
    from ropelab.data.verify import verify_checksums

    from pathlib import Path

    folder = Path(args.folder)
    manifest = read_manifest(folder)
    check_sizes(folder, manifest)
    verify_checksums(folder, manifest, remember=True, progress=not args.no_progress)  # always hashes
    shards = sum(len(info["shards"]) for info in manifest["splits"].values())
    print(f"{args.folder}: {shards} shard(s) match their sha256 checksums; tokenizer {manifest['tokenizer']} matches")
    return 0


DATA_COMMANDS: list[Command] = [
    ("prepare", _add_data_prepare, cmd_data_prepare, "tokenize a corpus into checksummed shards (resumable)"),
    ("verify", _add_data_verify, cmd_data_verify, "check a prepared folder's shards against their checksums"),
]


_add_data, cmd_data = command_group(DATA_COMMANDS, "data")


COMMANDS: list[Command] = [
    ("data", _add_data, cmd_data, "prepare corpora into token shards (`data prepare`) and check them (`data verify`)"),
]
