"""`ropelab study`, `report`, `memory` and `rope-base`: the partial-RoPE study and its arithmetic."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ropelab.cli.common import Command, numbers, positive_int, token_counts
from ropelab.config import ConfigError, MODEL_PRESETS
from ropelab.files import output_folder, writable_folder

SCORE_BIAS_NOTE = ("score bias / call: what one layer's bias (ALiBi) materialises for one sequence on the SDPA path, "
                   "the fp32 bias and its float mask (H x T x T); 0 on flex (a score_mod); under autograd each "
                   "layer's mask is kept for its backward")
REPORT_FILES = ("summary.csv", "summary.json", "loss_curves.png", "final_loss.png", "report.md", "report.html")


def _add_study(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="study YAML (base, variants, grid); default: the seed's fraction grid on tiny-llama")
    p.add_argument("--out", default="study", help="study directory (default: ./study)")
    p.add_argument("--jobs", type=positive_int, help="runs trained at once, CPU threads split between them (default: one per CPU core without CUDA, else 1)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (runs, tokens, FLOPs, GPU-hours, memory) and stop")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed MFU for the dry-run's GPU-hours (default 0.4)")
    p.add_argument("--no-live", action="store_true", help="no live overview (print a table at the end)")
    p.add_argument("--engine", choices=["auto", "eager"],
                   help="how runs are trained (default: the study's `engine`, auto): auto measures per group of runs "
                        "(same shape, sequence length and batch) whether compiled steps, one single-thread process per "
                        "core and an installed tcmalloc/jemalloc are faster, records it in DIR/engine.json; eager is "
                        "--jobs trainers, the cores split between them")


def default_jobs() -> int:
    import os

    import torch

    return 1 if torch.cuda.is_available() else max(1, os.cpu_count() or 1)


def cmd_study(args: argparse.Namespace) -> int:
    from ropelab.study.grid import default_study, expand, load_study
    from ropelab.study.plan import print_plan

    study = load_study(args.config) if args.config else default_study()
    if args.engine:
        study.engine = args.engine
    if args.dry_run:
        print_plan(expand(study), args.mfu)
        return 0
    from ropelab.study.pipeline import run_and_report
    from ropelab.train.lock import LOCK_FILE
    from ropelab.train.stop import EX_TEMPFAIL

    out = output_folder(args.out, "ropelab study", own=None)
    if not (out / "study.yaml").is_file():  # not a study yet (one is continued, see `ropelab.study.runner`)
        output_folder(out, "ropelab study", (LOCK_FILE,))  # the lock of a study stopped before its study.yaml
    writable_folder(out)
    outcome = run_and_report(study, out, jobs=args.jobs or default_jobs(), live=not args.no_live)
    statuses, paths = outcome["statuses"], outcome["report"]
    failed = [k for k, v in statuses.items() if v in ("failed", "skipped")]
    interrupted = [k for k, v in statuses.items() if v == "interrupted"]
    elsewhere = [k for k, v in statuses.items() if v == "elsewhere"]
    done = len(statuses) - len(failed) - len(interrupted) - len(elsewhere)
    print(f"study done: {done}/{len(statuses)} runs finished; report: {paths['report.html']}")
    if failed:
        print(f"failed runs (see runs/<id>/error.txt): {', '.join(failed)}")
    if interrupted:
        print(f"runs stopped by a signal (re-run the same command to continue them): {', '.join(interrupted)}")
    if elsewhere:
        print(f"runs another process is training, left alone (re-run the same command once it is done): "
              f"{', '.join(elsewhere)}")
    return 1 if failed else EX_TEMPFAIL if interrupted or elsewhere else 0


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("study_dir", help="a study directory (holding runs/)")
    p.add_argument("--target", type=float, help="loss for steps-to-target (default: what full RoPE reached)")
    p.add_argument("--out", help="write the report here instead of STUDY_DIR")


def cmd_report(args: argparse.Namespace) -> int:
    from ropelab.study.report import write_report

    if args.out is not None:  # a report rebuilt there before may be replaced, nothing else
        writable_folder(output_folder(args.out, "ropelab report", REPORT_FILES))
    elif Path(args.study_dir).is_dir():  # the report is written into the study
        writable_folder(args.study_dir)
    paths = write_report(args.study_dir, target=args.target, out_dir=args.out)
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


def _add_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--presets", default="llama-3.2-1b,pythia-1b,llama-3.1-8b", help="comma-separated model presets")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="dtype of the duplicated (HF-style) cache")
    p.add_argument("--gpus", type=int, default=8, help="GPUs for the replicated vs sharded columns")
    p.add_argument("--fractions", help="comma-separated rotated fractions in [0, 1], 2ch (two channels), pairs:R "
                                       "(a plan keeping R frequency pairs per KV head, the same in every KV head) "
                                       "or position types joined by + (rope, nope, fope, alibi, rope+alibi: the "
                                       "preset with that model.position) (default 0,2ch,0.1,0.25,0.5,0.75,1)")
    p.add_argument("--out", help="folder for memory.csv and memory.png")
    p.add_argument("--config", help="a run config YAML: also its cos/sin tables and key/value cache per layer kind")
    p.add_argument("--mla", help="MLA budgets PAIRS:RANK per KV head (e.g. 2:8,4:16): the key/value cache per token "
                                 "of each preset (and --model) beside its MHA/GQA cache")
    p.add_argument("--model", help="with --mla: also this model source (e.g. smollm2-135m; its config only)")


def cmd_memory(args: argparse.Namespace) -> int:
    import csv

    from rich.console import Console
    from rich.table import Table

    from ropelab.config import ModelConfig
    from ropelab.study.memory import DEFAULT_FRACTIONS, kept_pairs_of, memory_table, parse_entry, per_head_angles
    from ropelab.study.memory import plot_memory

    own = ("memory.csv", "memory.png")
    out = None if args.out is None else writable_folder(output_folder(args.out, "ropelab memory", own))
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    for name in presets:
        if name not in MODEL_PRESETS:
            raise ConfigError(f"--presets: unknown preset {name!r}; choose from {', '.join(MODEL_PRESETS)}")
    fractions = DEFAULT_FRACTIONS if args.fractions is None else [parse_entry(f) for f in args.fractions.split(",")]
    rows = memory_table(presets, fractions, dtype=args.dtype, gpus=args.gpus)
    table = Table(title=f"RoPE cache bytes per GPU (ropelab fp32 half-table | HF-style {args.dtype} duplicated; x{args.gpus} GPUs), "
                        f"the {args.dtype} KV cache of one sequence and a score bias per layer call")
    for col in ("preset", "fraction", "position", "dims", "seq_len", "ropelab", "HF-style replicated",
                f"HF-style sharded /{args.gpus}", "KV cache", "score bias / call"):
        table.add_column(col, justify="right")
    gib = lambda b: f"{b / 2**30:.3f} GiB"  # noqa: E731
    for r in rows:
        if r["seq_len"] in (2048, 131072, 1048576, 10_000_000):
            table.add_row(r["preset"], str(r["fraction"]), r["position"], str(r["rotary_dims"]), f"{r['seq_len']:,}",
                          gib(r["ropelab_bytes_replicated"]), gib(r["duplicated_bytes_replicated"]),
                          gib(r["duplicated_bytes_sharded"]), gib(r["kv_cache_bytes"]), gib(r["score_bias_bytes"]))
    Console().print(table)
    print("cache: none holds 0 bytes at any length (cos/sin computed from positions on the fly)")
    print(SCORE_BIAS_NOTE)
    mixing = {(r["preset"], r["fraction"]): r["mixing_macs_per_token"] for r in rows if r["mixing_macs_per_token"]}
    for (name, entry), macs in mixing.items():
        print(f"  {name} {entry}: a learned rotation mixes its cos/sin on every call: {macs:,} multiply-adds per token "
              "per layer")
    plans = [keep for keep in map(kept_pairs_of, fractions) if keep is not None]
    if plans:
        print("pairs:R is a plan keeping the same R pairs in every KV head: one (positions, R) table per distinct "
              "layer plan. A plan whose KV heads keep different pairs holds no table at any length; each layer "
              "forms K x R angles per token on every call (cos and sin, fp32):")
        for name in presets:
            config = ModelConfig.from_name(name)
            print(f"  {name}: " + ", ".join(f"R={keep}: {per_head_angles(config, keep)} angles, "
                                             f"{8 * per_head_angles(config, keep)} bytes per token per layer"
                                             for keep in plans))
    if args.config:
        _print_layer_kinds(args.config, args.dtype)
    if args.mla:
        _print_mla(args, presets)
    elif args.model:
        raise ConfigError("--model: only with --mla (the model whose MLA cache to show)")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "memory.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot_memory(rows, out / "memory.png")
        print(f"wrote {out / 'memory.csv'} and {out / 'memory.png'}")
    return 0


def _print_layer_kinds(path: str, dtype: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from ropelab.config import build_run_config, load_yaml
    from ropelab.study.memory import layer_kind_memory

    model = build_run_config(load_yaml(path)).model
    table = Table(title=f"{path}: per layer kind, fp32 cos/sin tables, the {dtype} key/value cache of one sequence "
                        "and, per layer call, the score bias (SDPA), angles and mixing per token")
    for col in ("seq_len", "kind", "layers", "position", "attention", "rotary dims", "cos/sin tables", "KV cache",
                "score bias / call", "angles / token", "mixing / token"):
        table.add_column(col, justify="right")
    for seq_len in sorted({n for n in (2048, 131072) if n < model.max_seq_len} | {model.max_seq_len}):
        for r in layer_kind_memory(model, seq_len, dtype):
            window = "" if r["window"] is None else f" {r['window']:,}"
            table.add_row(f"{seq_len:,}", r["kind"], ",".join(map(str, r["layers"])), r["position"],
                          r["attention"] + window, ",".join(map(str, r["rotary_dims"])), f"{r['rope_table_bytes']:,} B",
                          f"{r['kv_cache_bytes']:,} B", f"{r['score_bias_bytes']:,} B", f"{r['angles_per_token']:,}",
                          f"{r['mixing_macs_per_token']:,}")
    Console().print(table)
    print(SCORE_BIAS_NOTE)


def _print_mla(args: argparse.Namespace, presets: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ropelab.config import ModelConfig
    from ropelab.mla.memory import SEQ_LENS, mla_cache_rows, parse_budgets
    from ropelab.study.memory import DTYPE_BYTES

    budgets = parse_budgets(args.mla)
    models = [(name, ModelConfig.from_name(name)) for name in presets]
    if args.model:
        from ropelab.sources import load_config

        models.append((args.model, load_config(args.model)[0].model))
    table = Table(title=f"key/value cache, {args.dtype}: MHA/GQA against MLA (r RoPE pairs and a rank-d latent per KV head)")
    for col in ("model", "cache", "values/token/layer", "bytes/token/layer", "bytes/token", "saved",
                *(f"one sequence of {n:,}" for n in SEQ_LENS)):
        table.add_column(col, justify="right")
    for name, config in models:
        for r in mla_cache_rows(config, name, budgets, DTYPE_BYTES[args.dtype]):
            table.add_row(name, r["cache"], str(r["values_per_token_layer"]), f"{r['bytes_per_token_layer']:,}",
                          f"{r['bytes_per_token']:,}", f"{r['saved']:.1%}",
                          *(f"{r[f'bytes_at_{n}'] / 2**20:,.1f} MiB" for n in SEQ_LENS))
    Console().print(table)


def _add_rope_base(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", type=token_counts, default=[2048, 8192, 32768, 131072],
                   help="context lengths in tokens, k = 1024, M = 1024^2 (default 2k,8k,32k,128k; 128k takes 15-50 s per dims value on a CPU core)")
    p.add_argument("--dims", type=token_counts, default=[64, 128], help="rotary dims d (default 64,128: Llama-3.2-1B, Llama-3.1-8B)")
    p.add_argument("--theta", type=numbers, default=[10_000.0, 500_000.0], help="bases to check against each context (default 10000,500000)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def cmd_rope_base(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ropelab.rope.bound import bound_table

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


def _add_fit(p: argparse.ArgumentParser) -> None:
    p.add_argument("study_dir", metavar="STUDY_DIR", help="a frontier study's folder (a study YAML with a `frontier` key)")
    p.add_argument("--out", help="also write fit.md and its figures into this new (or empty) folder")


def cmd_fit(args: argparse.Namespace) -> int:
    from ropelab.study.frontier_report import fit_sections, write_fit

    if args.out is not None:
        paths = write_fit(args.study_dir, args.out)
        print(paths["fit.md"].read_text())
        print(f"written: {', '.join(str(p) for p in paths.values())}")
        return 0
    sections = fit_sections(args.study_dir)
    print("\n\n".join(f"## {s.title}\n\n{s.markdown}" for s in sections))
    return 0


COMMANDS: list[Command] = [
    ("study", _add_study, cmd_study, "run a grid of training runs and report bands, spikes and losses"),
    ("memory", _add_memory, cmd_memory, "position-encoding memory against sequence length: cos/sin tables per fraction (seed Fig. 1), KV cache and score bias per encoding"),
    ("rope-base", _add_rope_base, cmd_rope_base, "lower bound on the RoPE base for a context length per rotary dims (Men et al. 2024)"),
    ("report", _add_report, cmd_report, "rebuild a study's tables, plots and HTML report from its run directories"),
    ("fit", _add_fit, cmd_fit, "fit scaling laws to a frontier study: loss against tokens (and size), bootstrap intervals, held-out check"),
]
