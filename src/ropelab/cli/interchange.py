"""`ropelab export` and `ropelab import`: Hugging Face model folders."""

from __future__ import annotations

import argparse
from pathlib import Path

from ropelab.cli.common import Command


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run directory (latest checkpoint), <run>/checkpoints/step_N, or an imported folder")
    p.add_argument("--out", dest="out_dir", required=True, help="new folder for the Hugging Face model (must not exist or be empty)")
    p.add_argument("--layout", default="ropelab", help="ropelab (default: the native class, or ropelab's own code); "
                                                       "deepseek-v3 is not built and is refused")


def cmd_export(args: argparse.Namespace) -> int:
    from ropelab.export.hf import export_hf

    info = export_hf(args.source, args.out_dir, layout=args.layout)
    print(f"exported {info['checkpoint']} (step {info['step']}) as {info['architecture']} -> {info['out_dir']}")
    if info.get("route") == "remote_code":
        print(f"no native transformers class ({info['why']}): modeling code shipped; load with trust_remote_code=True "
              "(ropelab's own commands read it without)")
    print(f"files: {', '.join(info['files'])}")
    print(f"tokenizer: {info['tokenizer']}")
    return 0


def _add_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE", help="a Hugging Face hub name or model folder, a .gguf file, or a built-in name such as smollm2-135m (Llama, SmolLM3, Qwen2, Qwen3, GPT-NeoX)")
    p.add_argument("--out", dest="out_dir", help="new ropelab folder, must not exist or be empty (default: runs/<model name>)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run Python code shipped with the model, its config or its tokenizer "
                        "(off: such a model is refused; folders ropelab exported need no flag)")


def cmd_import(args: argparse.Namespace) -> int:
    from ropelab.sources import import_model

    out_dir = f"runs/{Path(args.source.rstrip('/')).stem}" if args.out_dir is None else args.out_dir
    info = import_model(args.source, out_dir, trust_remote_code=args.trust_remote_code)
    print(f"imported {info['source']} ({info['architecture']}, {info['params']:,} params) -> {info['out_dir']}")
    print(f"wrote config.yaml, {info['checkpoint']}, import.json; tokenizer: {info['tokenizer']}")
    return 0


COMMANDS: list[Command] = [
    ("export", _add_export, cmd_export, "write a run or checkpoint as a native Hugging Face model folder"),
    ("import", _add_import, cmd_import, "convert a Hugging Face or GGUF causal LM into a ropelab folder"),
]
