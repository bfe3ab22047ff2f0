"""What every command module shares: the command tuple, run-config arguments, grouped subcommands."""

from __future__ import annotations

import argparse
import math
from typing import Callable

from ropelab.config import MODEL_PRESETS, ConfigError, RunConfig, load_yaml

# (name, add_arguments(parser), handler(args) -> exit code, help)
Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]

OVERRIDES_HELP = """\
overrides are dotted key=value pairs, values parsed as YAML, e.g.
  model.rope.fraction=0.25   model.rope.rotary_dims=2   model.rope.theta=500000
  model.rope.style=slice|truncate   model.rope.layout=half|interleaved   model.rope.cache=table|none
  model.block=sequential|parallel   model.qk_norm=true   model.rope_layers={3: {fraction: 0}}
  data.seq_len=512   data.tokenizer=bytes|bpe:4096|smollm2-135m|<hf name or path>   data.positions=running|restart
  data.corpus=stdlib|stdlib-prose|wiki-prose|shakespeare|<folder from `ropelab data prepare`>   data.pack=cross|whole   data.mask_boundary_labels=true
  data.verify=once|always|sizes   attention.backend=auto|sdpa|dense|varlen|flex
  train.steps=200   train.micro_batch=8   train.grad_accum=2   train.lr=4e-4   train.precision=auto|bf16|fp32
  train.bf16_gemm=auto|native|fp32
  train.checkpoint_every=50   train.eval_every=50   attention.doc_mask=true   seed=1
  train.init_from=<run | checkpoint | HF folder or name | .gguf | smollm2-135m>  (fine-tune from its weights)
rope fraction rule: rotary_dims = 2*floor(fraction*head_dim/2), at least 2 for any fraction > 0.
"""


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config (keys as in the overrides below)")
    p.add_argument("--preset", help=f"model preset: {', '.join(MODEL_PRESETS)}")
    p.add_argument("--out", default="runs/default", help="run directory: new or empty, or a run to --resume "
                                                          "(default: runs/default)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--from-checkpoint", metavar="STEP|DIR", help="with --resume: continue from this checkpoint instead")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run config of --config, --preset and the overrides; with `train.init_from`, the source's
    model settings and tokenizer are the defaults (`ropelab.sources.run_config`)."""
    from ropelab.sources import run_config

    base = load_yaml(args.config) if args.config else {}
    overrides = list(args.overrides)
    if args.no_progress:
        overrides.append("train.progress=false")
    return run_config(base, args.preset, overrides)


def add_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file of this command's options (keys as the options' names with "
                                    "underscores, and the positional list); the command line wins")


def options_with_config(args: argparse.Namespace, names: tuple[str, ...], listed: str) -> dict:
    """{name: value} of the options `names` and the positional list `listed`: the command line's where
    given (not None, not empty), else `--config`'s. Unknown YAML keys are a one-line ConfigError."""
    values = {name: getattr(args, name) for name in (*names, listed)}
    if args.config:
        loaded = load_yaml(args.config)
        unknown = sorted(set(loaded) - set(values))
        if unknown:
            raise ConfigError(f"{args.config}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(values))}")
        for name, value in loaded.items():
            if values[name] in (None, []):
                values[name] = value
    if not values[listed]:
        raise ConfigError(f"{listed}: give one or more on the command line or as `{listed}:` in --config")
    if isinstance(values[listed], str):
        values[listed] = [values[listed]]
    return {name: value for name, value in values.items() if value is not None}


def command_group(table: list[Command], name: str) -> tuple[Callable, Callable]:
    """(add_arguments, handler) of a command with subcommands (`ropelab eval lm`, `ropelab data prepare`)."""

    def add_arguments(p: argparse.ArgumentParser) -> None:
        sub = p.add_subparsers(dest=f"{name}_command", required=True, metavar=name.upper())
        for sub_name, add_sub_arguments, handler, help_text in table:
            q = sub.add_parser(sub_name, help=help_text, description=help_text)
            add_sub_arguments(q)
            q.set_defaults(**{f"{name}_handler": handler})

    def run(args: argparse.Namespace) -> int:
        return getattr(args, f"{name}_handler")(args)

    return add_arguments, run


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a count, such as --jobs)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return value


def token_counts(text: str) -> list[int]:
    """argparse type: "256,2k,128k,1M" -> [256, 2048, 131072, 1048576] (k = 1024, M = 1024^2)."""
    scale = {"k": 2**10, "K": 2**10, "m": 2**20, "M": 2**20}
    try:
        return [int(float(t[:-1]) * scale[t[-1]]) if t[-1] in scale else int(t) for t in (x.strip() for x in text.split(",")) if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts, e.g. 256,2k,128k") from None


def numbers(text: str) -> list[float]:
    """argparse type: "0,0.25,1" -> [0.0, 0.25, 1.0]; nan and infinities are refused."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = [math.nan]
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated finite numbers, e.g. 0,0.5,1")
    return values
