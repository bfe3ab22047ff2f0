"""Command line: a thin layer over library functions. One table of subcommands, `COMMANDS`.

Every command turns user mistakes (`ConfigError`) into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from ropelab.config import ConfigError, MODEL_PRESETS, RunConfig, build_run_config, load_yaml

OVERRIDES_HELP = """\
overrides are dotted key=value pairs, values parsed as YAML, e.g.
  model.rope.fraction=0.25   model.rope.rotary_dims=2   model.rope.theta=500000
  model.rope.style=slice|truncate   model.rope.layout=half|interleaved   model.rope.cache=table|none
  model.block=sequential|parallel   model.qk_norm=true   model.rope_layers={3: {fraction: 0}}
  data.seq_len=512   data.tokenizer=bytes|bpe:4096|<hf name or path>   data.positions=running|restart
  train.steps=200   train.micro_batch=8   train.grad_accum=2   train.lr=4e-4   train.precision=auto|bf16|fp32
  train.checkpoint_every=50   train.eval_every=50   attention.doc_mask=true   seed=1
rope fraction rule: rotary_dims = 2*floor(fraction*head_dim/2), at least 2 for any fraction > 0.
"""


# --------------------------------------------------------------------------- train


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config (keys as in the overrides below)")
    p.add_argument("--preset", help=f"model preset: {', '.join(MODEL_PRESETS)}")
    p.add_argument("--out", default="runs/default", help="run directory (default: runs/default)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
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
        result = train(out_dir=args.out, resume=True)
    else:
        result = train(run_config_from_args(args), out_dir=args.out)
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
    from ropelab.study.report import write_report

    paths = write_report(args.out)
    failed = [k for k, v in statuses.items() if v == "failed"]
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


EVAL_COMMANDS: list[tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]] = [
    ("lm", _add_eval_lm, cmd_eval_lm, "zero-shot lm-evaluation-harness tasks (default: the seed's suite) on runs or checkpoints"),
]


def _add_eval(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    for name, add_arguments, handler, help_text in EVAL_COMMANDS:
        q = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(q)
        q.set_defaults(eval_handler=handler)


def cmd_eval(args: argparse.Namespace) -> int:
    return args.eval_handler(args)


# --------------------------------------------------------------------------- table

Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]

COMMANDS: list[Command] = [
    ("train", _add_train, cmd_train, "train one model (or resume one run)"),
    ("presets", _add_presets, cmd_presets, "list model presets with parameter counts"),
    ("study", _add_study, cmd_study, "run a grid of training runs and report bands, spikes and losses"),
    ("memory", _add_memory, cmd_memory, "RoPE cos/sin cache memory against sequence length per fraction (seed Fig. 1)"),
    ("report", _add_report, cmd_report, "rebuild a study's tables, plots and HTML report from its run directories"),
    ("export", _add_export, cmd_export, "write a run or checkpoint as a native Hugging Face model folder"),
    ("import", _add_import, cmd_import, "convert a Hugging Face causal LM into a ropelab folder"),
    ("eval", _add_eval, cmd_eval, "evaluate runs: `eval lm` runs lm-evaluation-harness tasks"),
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
    except KeyboardInterrupt:
        out = getattr(args, "out", None)
        hint = f"; resume with: ropelab {args.command} --out {out} --resume" if out else ""
        print(f"ropelab: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
