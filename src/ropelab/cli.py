"""Command line: a thin layer over library functions. One table of subcommands, `COMMANDS`.

Every command turns user mistakes (`ConfigError`) into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from ropelab.config import ConfigError, MODEL_PRESETS, RunConfig, build_run_config, load_yaml
from ropelab.errors import TrainingDiverged

# (name, add_arguments(parser), handler(args) -> exit code, help)
Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]

OVERRIDES_HELP = """\
overrides are dotted key=value pairs, values parsed as YAML, e.g.
  model.rope.fraction=0.25   model.rope.rotary_dims=2   model.rope.theta=500000
  model.rope.style=slice|truncate   model.rope.layout=half|interleaved   model.rope.cache=table|none
  model.block=sequential|parallel   model.qk_norm=true   model.rope_layers={3: {fraction: 0}}
  data.seq_len=512   data.tokenizer=bytes|bpe:4096|<hf name or path>   data.positions=running|restart
  data.corpus=stdlib|<folder from `ropelab data prepare`>   data.pack=cross|whole   data.mask_boundary_labels=true
  data.verify=once|always|sizes   attention.backend=auto|sdpa|dense|varlen|flex
  train.steps=200   train.micro_batch=8   train.grad_accum=2   train.lr=4e-4   train.precision=auto|bf16|fp32
  train.bf16_gemm=auto|native|fp32
  train.checkpoint_every=50   train.eval_every=50   attention.doc_mask=true   seed=1
rope fraction rule: rotary_dims = 2*floor(fraction*head_dim/2), at least 2 for any fraction > 0.
"""


# --------------------------------------------------------------------------- train


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config (keys as in the overrides below)")
    p.add_argument("--preset", help=f"model preset: {', '.join(MODEL_PRESETS)}")
    p.add_argument("--out", default="runs/default", help="run directory (default: runs/default)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--from-checkpoint", metavar="STEP|DIR", help="with --resume: continue from this checkpoint instead")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.add_argument("overrides", nargs="*", metavar="key=value")


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    base = load_yaml(args.config) if args.config else {}
    overrides = list(args.overrides)
    if args.no_progress:
        overrides.append("train.progress=false")
    return build_run_config(base, args.preset, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from ropelab.train.loop import train

    if args.resume:
        if args.config or args.preset or args.overrides:
            raise ConfigError("--resume continues the run with its saved config.yaml; drop --config/--preset/overrides")
        result = train(out_dir=args.out, resume=True, from_checkpoint=args.from_checkpoint)
    elif args.from_checkpoint:
        raise ConfigError("--from-checkpoint needs --resume")
    else:
        result = train(run_config_from_args(args), out_dir=args.out)
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 reports
        return 0
    print(
        f"done: {result.steps} steps, {result.tokens:,} tokens, train loss {result.final_train_loss:.4f}, "
        f"val loss {result.final_val_loss:.4f}, {result.tokens_per_s:,.0f} tokens/s -> {result.run_dir}"
    )
    return 0


# ------------------------------------------------------------------------- presets


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


# --------------------------------------------------------------------------- study


def _add_study(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="study YAML (base, variants, grid); default: the seed's fraction grid on tiny-llama")
    p.add_argument("--out", default="study", help="study directory (default: ./study)")
    p.add_argument("--jobs", type=int, help="runs trained at once, CPU threads split between them (default: one per CPU core without CUDA, else 1)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (runs, tokens, FLOPs, GPU-hours, memory) and stop")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed MFU for the dry-run's GPU-hours (default 0.4)")
    p.add_argument("--no-live", action="store_true", help="no live overview (print a table at the end)")


def default_jobs() -> int:
    import os

    import torch

    return 1 if torch.cuda.is_available() else max(1, os.cpu_count() or 1)


def cmd_study(args: argparse.Namespace) -> int:
    from ropelab.study.grid import default_study, expand, load_study
    from ropelab.study.plan import print_plan

    study = load_study(args.config) if args.config else default_study()
    if args.dry_run:
        print_plan(expand(study), args.mfu)
        return 0
    from ropelab.study.runner import run_study

    statuses = run_study(study, args.out, jobs=args.jobs or default_jobs(), live=not args.no_live)
    if study.longctx is not None:
        from ropelab.study.sections import evaluate_study_longctx

        evaluate_study_longctx(args.out, study.longctx, [k for k, v in statuses.items() if v == "done"], not args.no_live)
    from ropelab.study.report import write_report

    paths = write_report(args.out)
    failed = [k for k, v in statuses.items() if v in ("failed", "skipped")]
    print(f"study done: {len(statuses) - len(failed)}/{len(statuses)} runs finished; report: {paths['report.html']}")
    if failed:
        print(f"failed runs (see runs/<id>/error.txt): {', '.join(failed)}")
    return 1 if failed else 0


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("study_dir", help="a study directory (holding runs/)")
    p.add_argument("--target", type=float, help="loss for steps-to-target (default: what full RoPE reached)")
    p.add_argument("--out", help="write the report here instead of STUDY_DIR")


def cmd_report(args: argparse.Namespace) -> int:
    from ropelab.study.report import write_report

    paths = write_report(args.study_dir, target=args.target, out_dir=args.out)
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


# -------------------------------------------------------------------------- memory


def _add_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", default="llama-3.2-1b,pythia-1b,llama-3.1-8b", help="comma-separated model presets")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="dtype of the duplicated (HF-style) cache")
    p.add_argument("--gpus", type=int, default=8, help="GPUs for the replicated vs sharded columns")
    p.add_argument("--out", help="folder for memory.csv and memory.png")


def cmd_memory(args: argparse.Namespace) -> int:
    import csv
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from ropelab.study.memory import memory_table, plot_memory

    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    for name in presets:
        if name not in MODEL_PRESETS:
            raise ConfigError(f"--presets: unknown preset {name!r}; choose from {', '.join(MODEL_PRESETS)}")
    rows = memory_table(presets, dtype=args.dtype, gpus=args.gpus)
    table = Table(title=f"RoPE cache bytes per GPU (ropelab fp32 half-table | HF-style {args.dtype} duplicated; x{args.gpus} GPUs)")
    for col in ("preset", "fraction", "dims", "seq_len", "ropelab", "HF-style replicated", f"HF-style sharded /{args.gpus}"):
        table.add_column(col, justify="right")
    gib = lambda b: f"{b / 2**30:.3f} GiB"  # noqa: E731
    for r in rows:
        if r["seq_len"] in (2048, 131072, 1048576, 10_000_000):
            table.add_row(r["preset"], str(r["fraction"]), str(r["rotary_dims"]), f"{r['seq_len']:,}", gib(r["ropelab_bytes_replicated"]),
                          gib(r["duplicated_bytes_replicated"]), gib(r["duplicated_bytes_sharded"]))
    Console().print(table)
    print("cache: none holds 0 bytes at any length (cos/sin computed from positions on the fly)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "memory.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot_memory(rows, out / "memory.png")
        print(f"wrote {out / 'memory.csv'} and {out / 'memory.png'}")
    return 0


# ------------------------------------------------------------------------ rope-base


def _token_counts(text: str) -> list[int]:
    """argparse type: "256,2k,128k,1M" -> [256, 2048, 131072, 1048576] (k = 1024, M = 1024^2)."""
    scale = {"k": 2**10, "K": 2**10, "m": 2**20, "M": 2**20}
    try:
        return [int(float(t[:-1]) * scale[t[-1]]) if t[-1] in scale else int(t) for t in (x.strip() for x in text.split(",")) if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts, e.g. 256,2k,128k") from None


def _numbers(text: str) -> list[float]:
    """argparse type: "0,0.25,1" -> [0.0, 0.25, 1.0]."""
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 0,0.5,1") from None


def _add_rope_base(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=_token_counts, default=[2048, 8192, 32768, 131072],
                   help="context lengths in tokens, k = 1024, M = 1024^2 (default 2k,8k,32k,128k; 128k takes 15-50 s per dims value on a CPU core)")
    p.add_argument("--dims", type=_token_counts, default=[64, 128], help="rotary dims d (default 64,128: Llama-3.2-1B, Llama-3.1-8B)")
    p.add_argument("--theta", type=_numbers, default=[10_000.0, 500_000.0], help="bases to check against each context (default 10000,500000)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def cmd_rope_base(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ropelab.rope_bound import bound_table

    rows = bound_table(args.context, args.dims, args.theta, progress=not args.no_progress and not args.json)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cell = {(r["rotary_dims"], r["context"]): r for r in rows}
    table = Table(title="lower bound on the RoPE base (Men et al. 2024): B(m) = sum_i cos(m base^(-2i/d)) >= 0 for m <= context")
    table.add_column("rotary dims d", justify="right")
    for context in args.context:
        table.add_column(f"{context:,} tokens", justify="right")
    for d in args.dims:
        bounds = [cell[d, c]["base_lower_bound"] for c in args.context]
        table.add_row(str(d), *("none below 1e30" if b is None else f"{b:.3g}" for b in bounds))
    Console().print(table)
    if args.theta:
        check = Table(title="each base: first distance m with B(m) < 0, and the contexts it covers")
        for column in ("base", "d", "first m with B(m) < 0", *(f"{c:,}" for c in args.context)):
            check.add_column(column, justify="right")
        for theta in args.theta:
            for d in args.dims:
                firsts = [cell[d, c]["first_negative"][theta] for c in args.context]
                first = next((m for m in firsts if m is not None), None)
                check.add_row(f"{theta:g}", str(d), "none" if first is None else f"{first:,}",
                              *("ok" if m is None else "fails" for m in firsts))
        Console().print(check)
    return 0


# ------------------------------------------------------------------ export / import


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run directory (latest checkpoint), <run>/checkpoints/step_N, or an imported folder")
    p.add_argument("--out", dest="out_dir", required=True, help="new folder for the Hugging Face model (must not exist or be empty)")


def cmd_export(args: argparse.Namespace) -> int:
    from ropelab.evaluate.interchange import export_hf

    info = export_hf(args.source, args.out_dir)
    print(f"exported {info['checkpoint']} (step {info['step']}) as {info['architecture']} -> {info['out_dir']}")
    if info.get("route") == "remote_code":
        print(f"no native transformers class ({info['why']}): modeling code shipped; load with trust_remote_code=True")
    print(f"files: {', '.join(info['files'])}")
    print(f"tokenizer: {info['tokenizer']}")
    return 0


def _add_import(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="HF_NAME_OR_PATH", help="a Hugging Face hub name or a local model folder (Llama, Qwen2, Qwen3, GPT-NeoX)")
    p.add_argument("--out", dest="out_dir", help="new ropelab folder, must not exist or be empty (default: runs/<model name>)")


def cmd_import(args: argparse.Namespace) -> int:
    from ropelab.evaluate.interchange import import_hf

    out_dir = args.out_dir or f"runs/{args.source.rstrip('/').split('/')[-1]}"
    info = import_hf(args.source, out_dir)
    print(f"imported {info['source']} ({info['architecture']}, {info['params']:,} params) -> {info['out_dir']}")
    print(f"wrote config.yaml, {info['checkpoint']}, import.json; tokenizer: {info['tokenizer']}")
    return 0


# ------------------------------------------------------------------------- distill

DISTILL_HELP = """\
distill keys: distill.teacher=<HF name | HF folder | ropelab run or checkpoint>   distill.temperature=1
  distill.alpha=1 (1 = pure KD)   distill.top_k=<k>   distill.chunk_tokens=4096   distill.teacher_device=auto
  distill.teacher_precision=auto|fp32|bf16   distill.logits_cache=<folder written by `ropelab distill --cache`>
"""


def _add_distill(p: argparse.ArgumentParser) -> None:
    _add_train(p)
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
    args.out = args.out or "runs/default"
    if not args.resume:
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
    if not args.out and not args.dry_run:
        raise ConfigError("--out: required with --cache (a new folder for the teacher logits)")
    size = cache_teacher_logits(run_config_from_args(args), args.out, steps=args.steps, dry_run=args.dry_run,
                                dtype=args.dtype or "fp16")
    if not args.dry_run:
        print(f"wrote {size:,} bytes of teacher logits -> {args.out} (train with distill.logits_cache={args.out})")
    return 0


# ---------------------------------------------------------------------------- eval


def _add_eval_lm(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories, <run>/checkpoints/step_N folders or imported folders")
    p.add_argument("--tasks", default="paper",
                   help="`paper` (the seed's suite: arc_easy, arc_challenge, logiqa, lambada_openai, piqa, sciq, "
                        "winogrande, wsc273, pubmedqa) or comma-separated lm-eval task names (default: paper)")
    p.add_argument("--out", dest="out_dir", required=True, help="folder for results.json, results.md, lambada_ppl_vs_fraction.png")
    p.add_argument("--limit", type=float, help="at most N examples per task (a fraction if < 1); for quick checks only")
    p.add_argument("--include-path", help="folder of extra lm-eval task YAMLs")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--max-length", type=int, help="tokens per forward pass (default: the run's data.seq_len)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"], help="weights dtype (default float32)")


def cmd_eval_lm(args: argparse.Namespace) -> int:
    try:
        from ropelab.evaluate.lm_eval import evaluate_lm
    except ImportError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None

    results = evaluate_lm(args.runs, args.tasks, args.out_dir, limit=args.limit, include_path=args.include_path,
                          batch_size=args.batch_size, device=args.device, max_length=args.max_length, dtype=args.dtype)
    print(open(results["files"]["results.md"]).read().rstrip())
    print("wrote " + ", ".join(results["files"].values()))
    return 0


def _add_eval_longctx(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories, <run>/checkpoints/step_N folders or imported folders")
    p.add_argument("--out", dest="out_dir", required=True,
                   help="folder for longctx.json, longctx.md, longctx_heatmap.png, loss_by_position.png (not one holding earlier ones)")
    p.add_argument("--tasks", help="comma-separated: passkey, needle (default: both)")
    p.add_argument("--lengths", type=_token_counts, help="prompt lengths in tokens, k = 1024 (default 256,512,1k,2k,4k)")
    p.add_argument("--depths", type=_numbers, help="needle positions in the haystack, 0 = start, 1 = end (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--items", type=int, help="items per (length, depth) cell (default 2)")
    p.add_argument("--distractors", type=int, help="wrong answers the true one is ranked against (default 9)")
    p.add_argument("--digits", type=int, help="digits of the answer (default 5)")
    p.add_argument("--loss-length", type=int, help="loss-by-position window in tokens (default: the longest length; 0: skip)")
    p.add_argument("--loss-windows", type=int, help="validation windows for loss by position (default 4)")
    p.add_argument("--seed", type=int, help="item seed (default 0): equal seeds give equal items to runs of one data config")
    p.add_argument("--batch-size", type=int, help="prompts (or loss windows) per forward pass (default 8)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def cmd_eval_longctx(args: argparse.Namespace) -> int:
    from ropelab.evaluate.longctx import evaluate_longctx

    names = ("tasks", "lengths", "depths", "items", "distractors", "digits", "loss_length", "loss_windows", "seed", "batch_size")
    options = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    results = evaluate_longctx(args.runs, args.out_dir, device=args.device, progress=not args.no_progress, **options)
    print(open(results["files"]["longctx.md"]).read().rstrip())
    print("wrote " + ", ".join(results["files"].values()))
    return 0


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


EVAL_COMMANDS: list[Command] = [
    ("lm", _add_eval_lm, cmd_eval_lm, "zero-shot lm-evaluation-harness tasks (default: the seed's suite) on runs or checkpoints"),
    ("longctx", _add_eval_longctx, cmd_eval_longctx,
     "passkey and needle-in-a-haystack retrieval over context lengths x depths, and loss by position"),
]


_add_eval, cmd_eval = command_group(EVAL_COMMANDS, "eval")


# ---------------------------------------------------------------------------- data


def _add_data_prepare(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True,
                   help="stdlib; a .jsonl/.json/.parquet/.txt file or a folder of them (a .txt file is one document); "
                        "or a Hugging Face dataset: owner/name or hf:NAME (streamed)")
    p.add_argument("--hf-config", help="dataset config (subset) name, e.g. sample-100BT")
    p.add_argument("--split", default="train", help="dataset split to read (default: train)")
    p.add_argument("--text-field", default="text", help="field holding the text in json/parquet/dataset rows (default: text)")
    p.add_argument("--tokenizer", required=True, help="bytes, bpe:<vocab> (trained on stdlib), a tokenizer.json, or an HF name, e.g. EleutherAI/pythia-1b")
    p.add_argument("--out", dest="out_dir", required=True, help="folder for the shards (new, or an unfinished one to resume)")
    p.add_argument("--val-percent", type=float, default=2.0, help="share of documents held out for validation, by a hash of their text (default 2)")
    p.add_argument("--max-documents", type=int, help="stop after this many source documents")
    p.add_argument("--max-tokens", type=int, help="stop once this many tokens are written (e.g. a 100BT subset's first 1B)")
    p.add_argument("--shard-tokens", type=int, default=2**28, help="tokens per shard (default 2^28)")
    p.add_argument("--bos", action="store_true", help="prepend BOS to every document (EOS is always appended)")
    p.add_argument("--encoding-errors", default="strict", choices=["strict", "replace", "ignore"], help="undecodable bytes in .txt/json files (default: strict = error)")
    p.add_argument("--workers", type=int, help="tokenizer processes (default: one per CPU core)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from ropelab.data.prepare import prepare
    from ropelab.data.sources import Source
    from ropelab.data.tokenizer import load_tokenizer

    source = Source(args.source, args.hf_config, args.split, args.text_field, args.encoding_errors)
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        manifest = prepare(source, tokenizer, args.out_dir, val_percent=args.val_percent, max_documents=args.max_documents,
                           max_tokens=args.max_tokens, shard_tokens=args.shard_tokens, bos=args.bos, workers=args.workers,
                           progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"ropelab: interrupted; completed shards are kept in {args.out_dir}: re-run the same command to resume", file=sys.stderr)
        return 130
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
    verify_checksums(folder, manifest, remember=True, progress=not args.no_progress)
    shards = sum(len(info["shards"]) for info in manifest["splits"].values())
    print(f"{args.folder}: {shards} shard(s) match their sha256 checksums; tokenizer {manifest['tokenizer']} matches")
    return 0


DATA_COMMANDS: list[Command] = [
    ("prepare", _add_data_prepare, cmd_data_prepare, "tokenize a corpus into checksummed shards (resumable)"),
    ("verify", _add_data_verify, cmd_data_verify, "check a prepared folder's shards against their checksums"),
]


_add_data, cmd_data = command_group(DATA_COMMANDS, "data")


# --------------------------------------------------------------------------- probe


def _add_probe_run(p: argparse.ArgumentParser) -> None:
    from ropelab.probe.config import SEED_BLOCK_LEN, SEED_REPEATS, STAGES

    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                   help="run directories, <run>/checkpoints/step_N, imported folders, or Hugging Face Llama/GPT-NeoX/Qwen "
                        "folders or hub names (imported on the fly); the first is the reference")
    p.add_argument("--out", dest="out_dir", required=True, help="new folder for the results (must not exist or be empty)")
    p.add_argument("--block-len", type=int, default=SEED_BLOCK_LEN, help=f"tokens per block: BOS, text, EOS (default {SEED_BLOCK_LEN})")
    p.add_argument("--repeats", type=int, default=SEED_REPEATS, help=f"blocks in the window (default {SEED_REPEATS})")
    p.add_argument("--text", help="text file for the block's content (default: the first long-enough validation document "
                                  "of the first checkpoint's corpus)")
    p.add_argument("--modes", default="causal-fp32-running",
                   help="comma-separated modes, each ATTENTION-PRECISION-POSITIONS from causal|doc, fp32|bf16, running|restart "
                        "(words may be left out: they keep the seed's causal, fp32, running), or `all` (default: causal-fp32-running)")
    p.add_argument("--layers", default="all", help="comma-separated layer indices, negative from the end (default: all)")
    p.add_argument("--stages", default="all", help=f"comma-separated stages from {', '.join(STAGES)} (default: all)")
    p.add_argument("--top", type=int, default=10, help="weight-update spans listed as changed most (default 10)")
    p.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def cmd_probe_run(args: argparse.Namespace) -> int:
    from ropelab.probe import ProbeConfig, parse_layers, parse_modes, parse_stages, run_probe

    config = ProbeConfig(block_len=args.block_len, repeats=args.repeats, text_file=args.text, modes=parse_modes(args.modes),
                         layers=parse_layers(args.layers), stages=parse_stages(args.stages), device=args.device,
                         progress=not args.no_progress, top_spans=args.top)
    meta = run_probe(args.checkpoints, args.out_dir, config)
    print(f"probed {len(meta['checkpoints'])} checkpoint(s) x {len(meta['modes'])} mode(s) on {meta['window']:,} tokens "
          f"({meta['repeats']} x {meta['block_len']}) in {meta['wall_seconds']:.1f} s -> {meta['out_dir']}/index.html")
    print("\n".join(meta["findings"]))
    return 0


def _add_probe_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint_a", metavar="CKPT_A", help="the earlier checkpoint (the norms are its own)")
    p.add_argument("checkpoint_b", metavar="CKPT_B", help="the later checkpoint")
    p.add_argument("--out", dest="out_dir", required=True, help="new folder for weights.json, weights.png, index.html")
    p.add_argument("--top", type=int, default=10, help="spans listed as changed most (default 10)")


def cmd_probe_weights(args: argparse.Namespace) -> int:
    from ropelab.probe import weight_updates

    changes = weight_updates(args.checkpoint_a, args.checkpoint_b, args.out_dir, top=args.top)
    print("spans of W_q / W_k that changed most (||dW|| / ||W_A|| over their rows):")
    for s in changes["top_spans"]:
        wavelength = "" if s["wavelength_tokens"] is None else f", wavelength {s['wavelength_tokens']:.4g} tokens"
        print(f"  layer {s['layer']} W_{s['proj']} head {s['head']} {s['span']} (rows {s['rows'][0]}..{s['rows'][-1]}{wavelength}): "
              f"{s['relative_change']:.4g}")
    print(f"wrote {args.out_dir}/weights.json, weights.png, index.html")
    return 0


PROBE_COMMANDS: list[Command] = [
    ("run", _add_probe_run, cmd_probe_run,
     "repeat one block of text to fill the window and measure how each repeat's hidden states, queries, keys and logits move"),
    ("weights", _add_probe_weights, cmd_probe_weights,
     "change of W_q and W_k between two checkpoints per layer, head and rotary frequency pair"),
]


_add_probe, cmd_probe = command_group(PROBE_COMMANDS, "probe")


# --------------------------------------------------------------------------- table

COMMANDS: list[Command] = [
    ("train", _add_train, cmd_train, "train one model (or resume one run)"),
    ("distill", _add_distill, cmd_distill, "train a student by logit KD from a teacher (or, --cache, store teacher logits)"),
    ("presets", _add_presets, cmd_presets, "list model presets with parameter counts"),
    ("study", _add_study, cmd_study, "run a grid of training runs and report bands, spikes and losses"),
    ("memory", _add_memory, cmd_memory, "RoPE cos/sin cache memory against sequence length per fraction (seed Fig. 1)"),
    ("rope-base", _add_rope_base, cmd_rope_base, "lower bound on the RoPE base for a context length per rotary dims (Men et al. 2024)"),
    ("report", _add_report, cmd_report, "rebuild a study's tables, plots and HTML report from its run directories"),
    ("export", _add_export, cmd_export, "write a run or checkpoint as a native Hugging Face model folder"),
    ("import", _add_import, cmd_import, "convert a Hugging Face causal LM into a ropelab folder"),
    ("eval", _add_eval, cmd_eval, "evaluate runs: `eval lm` (lm-evaluation-harness tasks), `eval longctx` (passkey, needle, loss by position)"),
    ("data", _add_data, cmd_data, "prepare corpora into token shards (`data prepare`) and check them (`data verify`)"),
    ("probe", _add_probe, cmd_probe, "dissect positional information: `probe run` (repeated-block perturbation), `probe weights`"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ropelab", description="Train, distill, evaluate and dissect RoPE in decoder-only LMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add_arguments, handler, help_text in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=OVERRIDES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"ropelab: error: {exc}", file=sys.stderr)
        return 2
    except TrainingDiverged as exc:
        print(f"ropelab: training stopped: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        out = getattr(args, "out", None)
        hint = f"; resume with: ropelab {args.command} --out {out} --resume" if out else ""
        print(f"ropelab: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
