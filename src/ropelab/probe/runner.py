"""`run_probe` and `weight_updates`: the probe's two entry points, writing their output folders.

run_probe(CHECKPOINTS, OUT) writes
  probe.json                           what ran: checkpoints, modes, sequence, layers, stages, timings, files
  input.json, input_ids.npy, input.txt the probe sequence (metadata and analysis positions, ids, text)
  <checkpoint>/<mode>/captures.safetensors, metrics.json, heatmaps.png (channel x repeat, per stage)
                                       (metrics.json: per capture, and per layer kind given a layer pattern)
  lines_<mode>.png                     distance to the first repeat against position, every checkpoint
  comparison.json                      per mode: every checkpoint's metrics side by side, and differences
  weights_<a>__<b>.json/.png           weight updates from the first checkpoint to each other one
  index.html                           all of it on one page
weight_updates(A, B, OUT) writes weights.json, weights.png and index.html.

The folder is built under a temporary name next to OUT and renamed at the end, so OUT is either
complete or absent; an OUT that exists and is not empty is refused (nothing is overwritten).
"""

from __future__ import annotations

import html
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from ropelab.config import ConfigError
from ropelab.sources import load
from ropelab.probe import plots, report
from ropelab.probe.analysis import analyse_captures, by_layer_kind, compare, split_name
from ropelab.probe.capture import SafetensorsStream, capture
from ropelab.probe.channels import layer_rope
from ropelab.probe.config import ProbeConfig
from ropelab.probe.models import checkpoint_labels
from ropelab.probe.sequence import ProbeInput, probe_input_for, write_input
from ropelab.probe.weights import weight_changes
from ropelab.study.report import json_safe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@contextmanager
def fresh_folder(out_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir`, renamed to `out_dir` when the block succeeds, removed if not."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: already exists and is not empty; choose a new folder (nothing is overwritten)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--out {out}: was filled by someone else meanwhile; the probe stays unwritten")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(json_safe(data), indent=1) + "\n")


def probe_device(name: str) -> torch.device:
    """``auto``: the GPU when there is one, else the CPU; or a torch device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r}: not a device name (auto, cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name!r}: CUDA is not available on this machine")
    return device


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]probe"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), disable=not enabled)


def _check_tokens(label: str, config, tokenizer, reference, probe: ProbeInput) -> None:
    """Every checkpoint reads the same token ids, so they must share the tokenizer and its ids must fit."""
    if tokenizer.fingerprint() != reference.fingerprint():
        raise ConfigError(
            f"{label}: tokenizer {config.data.tokenizer!r} differs from the first checkpoint's; "
            "the probe feeds every checkpoint the same token ids"
        )
    if max(probe.block_ids) >= config.model.vocab_size:
        raise ConfigError(f"{label}: token id {max(probe.block_ids)} outside the model's vocabulary of {config.model.vocab_size}")


def _check_window(label: str, model_config, probe: ProbeInput) -> None:
    """A window longer than the model's context (model.max_seq_len) is refused, unless the model has a
    RoPE scaling, which is made to carry positions past its context: then one line warns."""
    if probe.window <= model_config.max_seq_len:
        return
    what = (f"{label}: the probe window, {probe.repeats} repeats x {probe.block_len} tokens = {probe.window:,}, is longer "
            f"than the model's model.max_seq_len={model_config.max_seq_len:,}")
    if all(model_config.rope_for_layer(i).scaling is None for i in range(model_config.n_layer)):
        raise ConfigError(f"{what}; choose --block-len and --repeats whose product is at most {model_config.max_seq_len:,}")
    print(f"ropelab: warning: {what}; probed with its RoPE scaling", file=sys.stderr)


def _probe_checkpoint(model, label: str, folder: Path, probe: ProbeInput, config: ProbeConfig, device, on_layer) -> dict:
    """Every mode on one model (fp32 modes first: the model is cast to bf16 in place once); writes
    each mode's captures, metrics and heatmaps. Returns {mode: {"metrics", "seconds"}}."""
    layers = config.layer_indices(model.config.n_layer)
    ropes = {layer: layer_rope(model.config, layer) for layer in layers}
    results = {}
    model.to(device)
    for mode in sorted(config.modes, key=lambda m: m.precision != "fp32"):
        model.to(DTYPES[mode.precision])
        mode_dir = folder / label / mode.name
        mode_dir.mkdir(parents=True)
        start = time.perf_counter()
        with SafetensorsStream(mode_dir / "captures.safetensors") as stream:
            capture(model, probe, mode, layers, config.stages, stream, on_layer)
            stream.finish({"checkpoint": label, "mode": mode.name, "layers": ",".join(map(str, layers))})
        seconds = time.perf_counter() - start
        found, panels = analyse_captures(mode_dir / "captures.safetensors", ropes)
        kinds = {} if model.config.layer_pattern is None else {
            "layer_kinds": by_layer_kind(found, {layer: model.config.kind_for_layer(layer) for layer in layers})}
        write_json(mode_dir / "metrics.json", {"checkpoint": label, "mode": mode.name, "forward_seconds": seconds,
                                               "captures": found, **kinds})
        (mode_dir / "heatmaps.png").write_bytes(plots.plot_deviation_heatmaps(panels, f"{label}, {mode.name}"))
        results[mode.name] = {"metrics": found, "seconds": seconds}
    return results


def _describe(label: str, source: str, model, layers: tuple[int, ...]) -> dict:
    c = model.config
    kind = {} if c.layer_pattern is None else {"layer_pattern": c.layer_pattern}
    return {"label": label, "source": str(source), "params": model.num_params(), "n_layer": c.n_layer,
            "max_seq_len": c.max_seq_len, **kind,
            "rope": [{"layer": i, "rotary_dims": r.rotary_dims, "layout": r.layout, "theta": r.theta}
                     | ({} if c.layer_pattern is None else {"kind": c.kind_for_layer(i)})
                     for i, r in ((i, layer_rope(c, i)) for i in layers)]}


def _probe_all(checkpoints: list[str], labels: list[str], folder: Path, config: ProbeConfig, progress) -> dict:
    """Load the checkpoints one at a time and probe each; the first decides the sequence (written
    to `folder`) and the layers. Returns the run's metadata with "results" per checkpoint."""
    device = probe_device(config.device)
    task = progress.add_task("loading", total=None)
    meta: dict[str, Any] = {"checkpoints": [], "device": str(device)}
    results, reference = {}, None
    for label, source in zip(labels, checkpoints):
        progress.update(task, description=f"{label}: loading")
        model, tokenizer, run_config = load(source)
        if reference is None:
            reference = tokenizer
            probe = probe_input_for(run_config, tokenizer, config.block_len, config.repeats, config.text_file)
            write_input(folder, probe)
            layers = config.layer_indices(model.config.n_layer)
            progress.update(task, total=len(checkpoints) * len(config.modes) * model.config.n_layer, completed=0)
        _check_tokens(label, run_config, tokenizer, reference, probe)
        _check_window(label, model.config, probe)
        if config.layer_indices(model.config.n_layer) != layers:
            raise ConfigError(f"{label}: has {model.config.n_layer} layers; --layers selects other layers than in the first checkpoint")
        meta["checkpoints"].append(_describe(label, source, model, layers))
        progress.update(task, description=f"{label}: forward")
        results[label] = _probe_checkpoint(model, label, folder, probe, config, device, lambda: progress.advance(task))
        del model
    progress.update(task, description="comparing and plotting")
    return meta | {
        "modes": [m.name for m in config.modes], "layers": list(layers), "stages": list(config.stages),
        "block_len": probe.block_len, "repeats": probe.repeats, "window": probe.window,
        "analysis_positions": probe.analysis_positions().tolist(), "input": probe.metadata(),
        "forward_seconds": {label: {m: r["seconds"] for m, r in per.items()} for label, per in results.items()},
        "results": results,
    }


def _compare_modes(folder: Path, meta: dict, labels: list[str]) -> dict:
    """comparison.json and lines_<mode>.png; returns {mode: comparison}."""
    comparison = {}
    for mode in meta["modes"]:
        metrics_by_label = {label: meta["results"][label][mode]["metrics"] for label in labels}
        comparison[mode] = compare(metrics_by_label)
        series = _line_series(metrics_by_label, meta["analysis_positions"])
        (folder / f"lines_{mode}.png").write_bytes(plots.plot_distance_lines(f"distance to the first repeat, {mode}", series))
    write_json(folder / "comparison.json", comparison)
    return comparison


def _line_series(metrics_by_label: dict[str, dict], positions: list[int]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for label, found in metrics_by_label.items():
        for name, entry in found.items():
            stage, layer = split_name(name)
            values = entry["kl"] if stage == "logits" else entry["relative_l2"]
            series.setdefault(stage, []).append({"checkpoint": label, "layer": layer, "positions": positions, "values": values})
    return series


def _weights_files(folder: Path, stem: str, sources: tuple[str, str], labels: tuple[str, str], top: int) -> dict:
    a, b = (load(source).model for source in sources)
    changes = weight_changes(a, b, top)
    write_json(folder / f"{stem}.json", {"checkpoints": dict(zip(labels, sources))} | changes)
    (folder / f"{stem}.png").write_bytes(plots.plot_weight_heatmap(changes, f"{labels[0]} → {labels[1]}"))
    return changes


def _weights_sections(folder: Path, checkpoints: list[str], labels: list[str], top: int) -> tuple[list[str], dict]:
    """Weight updates from the first checkpoint to each other one: HTML sections, and {label: why
    skipped} for checkpoints whose shapes or rotation differ from the first's."""
    sections, skipped = [], {}
    for label, source in zip(labels[1:], checkpoints[1:]):
        stem = f"weights_{labels[0]}__{label}"
        try:
            changes = _weights_files(folder, stem, (checkpoints[0], source), (labels[0], label), top)
        except ConfigError as exc:
            skipped[label] = str(exc)
            continue
        sections.append(report.weights_section(changes, (labels[0], label), f"{stem}.png"))
    return sections, skipped


def run_probe(checkpoints: list[str], out_dir: str | Path, config: ProbeConfig | None = None) -> dict:
    """Probe `checkpoints` (run dirs, checkpoint folders, imported or Hugging Face folders, hub
    names) with the repeated-block sequence and write `out_dir` (see the module docstring). A window
    longer than a checkpoint's model.max_seq_len is refused, or with a RoPE scaling warned about.
    Returns probe.json's content plus ``out_dir`` and ``findings`` (one line per mode and checkpoint)."""
    config = (config or ProbeConfig()).validate()
    if not checkpoints:
        raise ConfigError("probe: give at least one checkpoint")
    labels = checkpoint_labels(checkpoints)
    wall = time.perf_counter()
    with fresh_folder(out_dir) as tmp, _progress(config.progress) as progress:
        meta = _probe_all(checkpoints, labels, tmp, config, progress)
        comparison = _compare_modes(tmp, meta, labels)
        weight_sections, meta["weights_skipped"] = _weights_sections(tmp, checkpoints, labels, config.top_spans)
        found = report.findings(comparison, labels)
        sections = [report.input_section(meta), "<ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in found) + "</ul>"]
        sections += [report.mode_section(mode, comparison[mode], labels, f"lines_{mode}.png",
                                         {label: f"{label}/{mode}/heatmaps.png" for label in labels}) for mode in meta["modes"]]
        sections += weight_sections + [f"<p>weight updates of {html.escape(label)} skipped: {html.escape(why)}</p>"
                                       for label, why in meta["weights_skipped"].items()]
        page = report.page("ropelab probe: positional perturbation across repeats", "\n".join(sections))
        (tmp / "index.html").write_text(page)
        del meta["results"]  # in each mode's metrics.json
        meta["wall_seconds"] = time.perf_counter() - wall
        meta["files"] = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()) + ["probe.json"]
        write_json(tmp / "probe.json", meta)
    return meta | {"out_dir": str(out_dir), "findings": found}


def weight_updates(checkpoint_a: str, checkpoint_b: str, out_dir: str | Path, top: int = 10) -> dict:
    """The change in W_q and W_k from checkpoint A to B (see `weights.weight_changes`), written
    to `out_dir` as weights.json, weights.png and index.html. Returns the changes."""
    if top < 1:
        raise ConfigError(f"--top={top}: must be >= 1")
    labels = tuple(checkpoint_labels([checkpoint_a, checkpoint_b]))
    with fresh_folder(out_dir) as tmp:
        changes = _weights_files(tmp, "weights", (checkpoint_a, checkpoint_b), labels, top)
        body = report.weights_section(changes, labels, "weights.png")
        (tmp / "index.html").write_text(report.page(f"ropelab probe weights: {labels[0]} → {labels[1]}", body))
    return changes
