"""`ropelab train`, `ropelab distill` and `ropelab presets`."""

from __future__ import annotations

import argparse
import json
import os

from ropelab.cli.common import OVERRIDES_HELP, Command, add_run_arguments, run_config_from_args
from ropelab.config import ConfigError, MODEL_PRESETS, build_run_config
from ropelab.files import output_folder, writable_folder


def cmd_train(args: argparse.Namespace) -> int:
    import ropelab.distill  # noqa: F401 - registers the KD objective for configs with a distill section
    from ropelab.train.loop import train
    from ropelab.train.run_folder import check_new_run_folder

    if args.resume:
        if args.config or args.preset or args.overrides:
            raise ConfigError("--resume continues the run with its saved config.yaml; drop --config/--preset/overrides")
        output_folder(args.out, "ropelab train", own=None)
        result = train(out_dir=args.out, resume=True, from_checkpoint=args.from_checkpoint)
    elif args.from_checkpoint:
        raise ConfigError("--from-checkpoint needs --resume")
    else:
        check_new_run_folder(args.out)  # before the config: a source named by train.init_from may take long to read
        result = train(run_config_from_args(args), out_dir=args.out)
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 reports
        return 0
    print(
        f"done: {result.steps} steps, {result.tokens:,} tokens, train loss {result.final_train_loss:.4f}, "
        f"val loss {result.final_val_loss:.4f}, {result.tokens_per_s:,.0f} tokens/s -> {result.run_dir}"
    )
    return 0


def _add_train_stacked(p: argparse.ArgumentParser) -> None:
    p.add_argument("--member", nargs=2, action="append", required=True, metavar=("CONFIG", "OUT"),
                   help="a run's YAML config (as `ropelab train --config`) and its new run folder; repeat per member")


def cmd_train_stacked(args: argparse.Namespace) -> int:
    """Fresh runs of one shape trained as one stacked model (`ropelab.train.stacked_loop`); exit 1
    when a member diverged (its folder holds error.txt), 75 on SIGTERM/SIGUSR1 with every member checkpointed."""
    import sys

    from ropelab.config import load_yaml
    from ropelab.train.stacked_loop import train_stacked

    configs = []
    for path, _ in args.member:
        base = load_yaml(path)  # its refusals name the file
        try:
            configs.append(build_run_config(base))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    results = train_stacked(configs, [out for _, out in args.member])
    for (_, out), result in zip(args.member, results):
        if result is None:
            print(f"failed: {out} diverged (see {out}/error.txt)", file=sys.stderr)
        else:
            print(f"done: {result.steps} steps, {result.tokens:,} tokens, train loss {result.final_train_loss:.4f}, "
                  f"val loss {result.final_val_loss:.4f}, {result.tokens_per_s:,.0f} tokens/s -> {result.run_dir}")
    return 1 if any(result is None for result in results) else 0


def _add_presets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def preset_table() -> list[dict]:
    from ropelab.model import count_params_meta

    rows = []
    for name, cfg in MODEL_PRESETS.items():
        sized = cfg if cfg.vocab_size else build_run_config({"model": {"preset": name, "vocab_size": 4096}}).model
        rotary = cfg.rope.resolve_dims(cfg.head_size)
        rows.append({
            "name": name, "params": count_params_meta(sized), "vocab_size": sized.vocab_size,
            "n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head, "n_kv_head": cfg.kv_heads,
            "head_dim": cfg.head_size, "d_ff": cfg.d_ff, "block": cfg.block, "rotary_dims": rotary,
            "rope_theta": cfg.rope.theta, "qk_norm": cfg.qk_norm, "tie_embeddings": cfg.tie_embeddings,
        })
    return rows


def cmd_presets(args: argparse.Namespace) -> int:
    rows = preset_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ropelab model presets (tiny presets sized with a 4096-token vocabulary)")
    for col in ("name", "params", "block", "n_layer", "d_model", "heads (q/kv x dim)", "d_ff", "rotary_dims", "theta", "vocab"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], f"{r['params']:,}", r["block"], str(r["n_layer"]), str(r["d_model"]),
                      f"{r['n_head']}/{r['n_kv_head']} x {r['head_dim']}", str(r["d_ff"]), str(r["rotary_dims"]),
                      f"{r['rope_theta']:g}", str(r["vocab_size"]))
    Console().print(table)
    return 0


DISTILL_HELP = """\
distill keys: distill.teacher=<HF name | HF folder | ropelab run or checkpoint>   distill.temperature=1
  distill.alpha=1 (1 = pure KD)   distill.top_k=<k>   distill.chunk_tokens=4096   distill.teacher_device=auto
  distill.teacher_precision=auto|fp32|bf16   distill.logits_cache=<folder written by `ropelab distill --cache`>
"""


def _add_distill(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.add_argument("--cache", action="store_true",
                   help="instead of training, write the teacher's top-k logits for every batch of the run into --out")
    p.add_argument("--dry-run", action="store_true", help="with --cache: print the cache size and stop")
    p.add_argument("--steps", type=int, help="with --cache: only the run's first N optimizer steps (default: all)")
    p.add_argument("--dtype", choices=["fp16", "fp32"], help="with --cache: log-probability storage (default fp16)")
    p.set_defaults(out=None)  # training: runs/default; --cache: required (a new folder)
    p.epilog = OVERRIDES_HELP + DISTILL_HELP


def cmd_distill(args: argparse.Namespace) -> int:
    """`ropelab train` for a config with a distill section, after checking the teacher (or the logits
    cache) against the run; with --cache, `cache_teacher_logits` instead."""
    if args.cache:
        return _distill_cache(args)
    if args.dry_run or args.steps is not None or args.dtype:
        raise ConfigError("--dry-run, --steps and --dtype go with --cache")
    args.out = "runs/default" if args.out is None else args.out
    if not args.resume:
        from ropelab.train.run_folder import check_new_run_folder

        check_new_run_folder(args.out)  # before the teacher is loaded
        config = run_config_from_args(args)
        if config.distill is None:
            raise ConfigError("distill: no distill section; set distill.teacher=... (plain training: `ropelab train`)")
        if config.distill.logits_cache:
            from ropelab.distill.cache import CachedTeacher

            CachedTeacher(config.distill.logits_cache, config)
        else:
            from ropelab.distill.teacher import check_teacher

            check_teacher(config)
    return cmd_train(args)


def _distill_cache(args: argparse.Namespace) -> int:
    from ropelab.distill.cache import cache_teacher_logits

    if args.resume or args.from_checkpoint:
        raise ConfigError("--cache writes a new folder; --resume and --from-checkpoint go with training")
    if args.out is None and not args.dry_run:
        raise ConfigError("--out: required with --cache (a new folder for the teacher logits)")
    if not args.dry_run:
        writable_folder(output_folder(args.out, "ropelab distill --cache"))
    size = cache_teacher_logits(run_config_from_args(args), args.out, steps=args.steps, dry_run=args.dry_run,
                                dtype=args.dtype or "fp16")
    if not args.dry_run:
        print(f"wrote {size:,} bytes of teacher logits -> {args.out} (train with distill.logits_cache={args.out})")
    return 0


COMMANDS: list[Command] = [
    ("train", add_run_arguments, cmd_train, "train one model (or resume one run)"),
    ("train-stacked", _add_train_stacked, cmd_train_stacked,
     "train fresh runs of one shape as one stacked model, each folder as `train` writes it"),
    ("distill", _add_distill, cmd_distill, "train a student by logit KD from a teacher (or, --cache, store teacher logits)"),
    ("presets", _add_presets, cmd_presets, "list model presets with parameter counts"),
]
