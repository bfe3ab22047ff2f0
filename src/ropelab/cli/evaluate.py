"""`ropelab eval lm`, `ropelab eval longctx` and `ropelab eval extrapolation`."""

from __future__ import annotations

import argparse

from ropelab.cli.common import Command, add_config_argument, command_group, numbers, options_with_config, token_counts
from ropelab.config import ConfigError
from ropelab.files import output_folder, writable_folder


def _add_eval_lm(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories, <run>/checkpoints/step_N folders or imported folders")
    p.add_argument("--tasks", default="paper",
                   help="`paper` (the seed's suite: arc_easy, arc_challenge, logiqa, lambada_openai, piqa, sciq, "
                        "winogrande, wsc273, pubmedqa) or comma-separated lm-eval task names (default: paper)")
    p.add_argument("--out", dest="out_dir", required=True, help="new (or empty) folder for results.json, results.md, lambada_ppl_vs_fraction.png")
    p.add_argument("--limit", type=float, help="at most N examples per task (a fraction if < 1); for quick checks only")
    p.add_argument("--include-path", help="folder of extra lm-eval task YAMLs")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--max-length", type=int, help="tokens per forward pass (default: the run's data.seq_len)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"], help="weights dtype (default float32)")


def cmd_eval_lm(args: argparse.Namespace) -> int:
    writable_folder(output_folder(args.out_dir, "ropelab eval lm"))
    try:
        from ropelab.evaluate.lm_eval import evaluate_lm
    except ImportError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None

    results = evaluate_lm(args.runs, args.tasks, args.out_dir, limit=args.limit, include_path=args.include_path,
                          batch_size=args.batch_size, device=args.device, max_length=args.max_length, dtype=args.dtype)
    print(open(results["files"]["results.md"]).read().rstrip())
    print("wrote " + ", ".join(results["files"].values()))
    return 0


def _add_sources(p: argparse.ArgumentParser, files: str) -> None:
    p.add_argument("runs", nargs="*", metavar="RUN", help="model sources: runs, <run>/checkpoints/step_N, imported or HF "
                                                           "folders, .gguf files, smollm2-135m")
    add_config_argument(p)
    p.add_argument("--out", dest="out_dir", required=True, help=f"new (or empty) folder for {files}")


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


def _evaluate_sources(args: argparse.Namespace, names: tuple[str, ...], evaluate, table: str) -> int:
    """The options of the command line and --config into the library call; prints the `table` file."""
    writable_folder(output_folder(args.out_dir, f"ropelab eval {args.eval_command}"))
    options = options_with_config(args, names, "runs")
    runs = options.pop("runs")
    results = evaluate(runs, args.out_dir, progress=not args.no_progress, **options)
    print(open(results["files"][table]).read().rstrip())
    print("wrote " + ", ".join(results["files"].values()))
    return 0


def _add_eval_longctx(p: argparse.ArgumentParser) -> None:
    _add_sources(p, "longctx.json, longctx.md, longctx_heatmap.png, loss_by_position.png")
    p.add_argument("--tasks", help="comma-separated: passkey, needle, ruler (all of RULER's synthetic tasks) or RULER's "
                                   "niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe "
                                   "(default: passkey,needle)")
    p.add_argument("--lengths", type=token_counts, help="prompt lengths in tokens, k = 1024; for RULER's tasks the "
                                                          "prompt and its new tokens (default 256,512,1k,2k,4k)")
    p.add_argument("--depths", type=numbers, help="needle positions in the haystack, 0 = start, 1 = end (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--items", type=int, help="items per (length, depth) cell; per length for RULER's tasks (default 2)")
    p.add_argument("--threshold", type=float, help="RULER's effective length: the longest length whose RULER-11 mean "
                                                     "(%%) is above this (default 85.6: Llama-2-7B-chat's mean over RULER's "
                                                     "13 tasks at 4K under its chat template)")
    p.add_argument("--haystack", help="the essay haystack of niah_single_2/3, niah_multikey_1, niah_multivalue and "
                                      "niah_multiquery: wiki-prose (default, Wikipedia lead sections), stdlib-prose, or "
                                      "the path of RULER's own PaulGrahamEssays.json to reproduce RULER's haystacks")
    p.add_argument("--distractors", type=int, help="wrong answers the true one is ranked against (default 9)")
    p.add_argument("--digits", type=int, help="characters of the answer (default 5)")
    p.add_argument("--answer-alphabet", choices=("digits", "letters"),
                   help="what passkeys and needles are made of (default digits; letters for models that never saw digits)")
    p.add_argument("--loss-length", type=int, help="loss-by-position window in tokens (default: the longest length; 0: skip)")
    p.add_argument("--loss-windows", type=int, help="validation windows for loss by position (default 4)")
    p.add_argument("--loss-place", choices=("start", "inside"),
                   help="loss-by-position windows at document starts (default) or at random offsets inside long documents")
    p.add_argument("--seed", type=int, help="item seed (default 0): equal seeds give equal items to runs of one data config")
    p.add_argument("--batch-size", type=int, help="prompts (or loss windows) per forward pass (default 8)")
    _add_device(p)


def cmd_eval_longctx(args: argparse.Namespace) -> int:
    from ropelab.evaluate.longctx import evaluate_longctx

    names = ("tasks", "lengths", "depths", "items", "threshold", "haystack", "distractors", "digits", "answer_alphabet",
             "loss_length", "loss_windows", "loss_place", "seed", "batch_size", "device")
    return _evaluate_sources(args, names, evaluate_longctx, "longctx.md")


def _add_eval_extrapolation(p: argparse.ArgumentParser) -> None:
    _add_sources(p, "extrapolation.json, extrapolation.md, loss_by_position.png")
    p.add_argument("--lengths", type=token_counts, help="context lengths in tokens, k = 1024; beyond the training length "
                                                         "(and max_seq_len) is the point, e.g. 512,1k,2k")
    p.add_argument("--methods", help="comma-separated: none, linear, ntk, yarn, dynamic, llama3 "
                                     "(default none,linear,ntk,yarn,dynamic; none = the model as trained)")
    p.add_argument("--factor", type=float, help="every method's factor (default: length / trained length at each length)")
    p.add_argument("--windows", type=int, help="validation windows for loss by position (default 4)")
    p.add_argument("--no-passkey", dest="passkey", action="store_const", const=False,
                   help="loss by position only (passkey retrieval costs about one forward pass per item)")
    p.add_argument("--depths", type=numbers, help="passkey needle positions, 0 = start, 1 = end (default 0,0.5,1)")
    p.add_argument("--items", type=int, help="passkey items per (length, depth) (default 2)")
    p.add_argument("--distractors", type=int, help="wrong passkeys the true one is ranked against (default 9)")
    p.add_argument("--digits", type=int, help="digits of the passkey (default 5)")
    p.add_argument("--buckets", type=int, help="log-spaced position buckets of loss by position (default 12)")
    p.add_argument("--seed", type=int, help="window and item seed (default 0)")
    p.add_argument("--batch-size", type=int, help="windows or prompts per forward pass (default 4)")
    _add_device(p)


def cmd_eval_extrapolation(args: argparse.Namespace) -> int:
    from ropelab.evaluate.extrapolation import evaluate_extrapolation

    names = ("lengths", "methods", "factor", "windows", "passkey", "depths", "items", "distractors", "digits", "buckets",
             "seed", "batch_size", "device")
    return _evaluate_sources(args, names, evaluate_extrapolation, "extrapolation.md")


EVAL_COMMANDS: list[Command] = [
    ("lm", _add_eval_lm, cmd_eval_lm, "zero-shot lm-evaluation-harness tasks (default: the seed's suite) on runs or checkpoints"),
    ("longctx", _add_eval_longctx, cmd_eval_longctx,
     "passkey and needle-in-a-haystack retrieval over context lengths x depths, RULER's synthetic tasks, loss by position"),
    ("extrapolation", _add_eval_extrapolation, cmd_eval_extrapolation,
     "RoPE scaling methods (none, linear, ntk, yarn, dynamic) beyond the trained length: loss by position, passkey"),
]


_add_eval, cmd_eval = command_group(EVAL_COMMANDS, "eval")


COMMANDS: list[Command] = [
    ("eval", _add_eval, cmd_eval, "evaluate runs: `eval lm` (lm-evaluation-harness tasks), `eval longctx` (passkey, needle, RULER, loss by position), "
                                  "`eval extrapolation` (RoPE scaling methods beyond the trained length)"),
]
