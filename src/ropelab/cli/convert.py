"""`ropelab convert`: keep some RoPE frequency pairs of a pretrained model (partial RoPE)."""

from __future__ import annotations

import argparse

from ropelab.cli.common import Command

CONVERT_HELP = ("settings as dotted key=value: rope.keep_pairs=4 (0..head_dim/2; 0 = NoPE), "
                "rope.select=high|low|uniform|2-norm|list, rope.pairs=[...] (with list: one entry per layer), "
                "calibration.corpus=stdlib calibration.tokens=65536 calibration.seq_len=512 calibration.seed=0, "
                "eval.tokens=16384 eval.seq_len=512 (held-out loss and KL to the source)")


def _add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE", help="any model source with full RoPE: run, checkpoint, imported or HF folder, .gguf, smollm2-135m")
    p.add_argument("--out", dest="out_dir", required=True, help="new folder for the converted model (must not exist or be empty)")
    p.add_argument("--config", help="YAML of the settings below; key=value on the command line wins")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=CONVERT_HELP)


def cmd_convert(args: argparse.Namespace) -> int:
    from ropelab.config import load_yaml
    from ropelab.convert import convert_model

    tree = load_yaml(args.config) if args.config else None
    record = convert_model(args.source, args.out_dir, args.overrides, tree)
    print(f"wrote {record['out_dir']} (convert.json, pairs.png); train it with train.init_from={record['out_dir']}")
    return 0


COMMANDS: list[Command] = [
    ("convert", _add_convert, cmd_convert, "keep some RoPE frequency pairs of a model (partial RoPE), ready to recover"),
]
