"""`ropelab probe run` and `ropelab probe weights`."""

from __future__ import annotations

import argparse

from ropelab.cli.common import Command, add_config_argument, command_group, options_with_config
from ropelab.files import output_folder, writable_folder


def _add_probe_run(p: argparse.ArgumentParser) -> None:
    from ropelab.probe.config import SEED_BLOCK_LEN, SEED_REPEATS, STAGES

    p.add_argument("checkpoints", nargs="*", metavar="CHECKPOINT",
                   help="model sources: run directories, <run>/checkpoints/step_N, imported folders, Hugging Face "
                        "Llama/GPT-NeoX/Qwen folders or hub names, .gguf files, smollm2-135m; the first is the reference")
    add_config_argument(p)
    p.add_argument("--out", dest="out_dir", required=True, help="new folder for the results (must not exist or be empty)")
    p.add_argument("--block-len", type=int, help=f"tokens per block: BOS, text, EOS (default {SEED_BLOCK_LEN})")
    p.add_argument("--repeats", type=int, help=f"blocks in the window (default {SEED_REPEATS})")
    p.add_argument("--text", help="text file for the block's content (default: the first long-enough validation document "
                                  "of the first checkpoint's corpus)")
    p.add_argument("--modes",
                   help="comma-separated modes, each ATTENTION-PRECISION-POSITIONS from causal|doc, fp32|bf16, running|restart "
                        "(words may be left out: they keep the seed's causal, fp32, running), or `all` (default: causal-fp32-running)")
    p.add_argument("--layers", help="comma-separated layer indices, negative from the end (default: all)")
    p.add_argument("--stages", help=f"comma-separated stages from {', '.join(STAGES)} (default: all)")
    p.add_argument("--top", type=int, help="weight-update spans listed as changed most (default 10)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")


PROBE_OPTIONS = ("block_len", "repeats", "text", "modes", "layers", "stages", "top", "device")


def probe_config(options: dict, progress: bool = True):
    """The `ProbeConfig` of `probe run`'s options (command line or --config), validated."""
    from ropelab.probe import ProbeConfig, parse_layers, parse_modes, parse_stages
    from ropelab.probe.config import SEED_BLOCK_LEN, SEED_REPEATS

    return ProbeConfig(
        block_len=options.get("block_len", SEED_BLOCK_LEN), repeats=options.get("repeats", SEED_REPEATS),
        text_file=options.get("text"), modes=parse_modes(str(options.get("modes", "causal-fp32-running"))),
        layers=parse_layers(str(options.get("layers", "all"))), stages=parse_stages(str(options.get("stages", "all"))),
        device=options.get("device", "auto"), progress=progress, top_spans=options.get("top", 10),
    ).validate()


def cmd_probe_run(args: argparse.Namespace) -> int:
    from ropelab.probe import run_probe

    writable_folder(output_folder(args.out_dir, "ropelab probe run"))
    options = options_with_config(args, PROBE_OPTIONS, "checkpoints")
    meta = run_probe(options["checkpoints"], args.out_dir, probe_config(options, progress=not args.no_progress))
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

    writable_folder(output_folder(args.out_dir, "ropelab probe weights"))
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


COMMANDS: list[Command] = [
    ("probe", _add_probe, cmd_probe, "dissect positional information: `probe run` (repeated-block perturbation), `probe weights`"),
]
