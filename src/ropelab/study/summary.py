"""Study summary: read every run of a study and reduce it to one row per run, plus the findings.

Layout read::

    study_dir/runs/<run_id>/config.yaml     resolved run config (see `ropelab.config.RunConfig`)
    study_dir/runs/<run_id>/metrics.jsonl   one row per logged step (`ropelab.train.loop`)
    study_dir/runs/<run_id>/result.json     present when the run finished
    study_dir/runs/<run_id>/error.txt       present when the run failed (its text is the error)

Runs are compared inside *comparison groups*: runs whose configs are equal once the seed, the
RoPE fraction / rotary_dims and bookkeeping keys (device, progress, eval / checkpoint cadence)
are removed. Convergence bands and the steps-to-target reference (full RoPE's final loss) are
computed per group; the noise that sets the band threshold is pooled over the whole study.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from ropelab.config import DataConfig, ModelConfig, TrainConfig, build_run_config, resolve_rotary_dims
from ropelab.study import analysis

__all__ = [
    "Run", "collect_runs", "read_metrics_tolerant", "summarize", "findings", "fraction_label", "COLUMNS",
    "TAIL_FRACTION", "BAND_FACTOR", "BOOKKEEPING", "ROPE_AMOUNT",
]

TAIL_FRACTION = 0.1  # final loss = mean over the last 10 % of steps
BAND_FACTOR = 3.0  # a new band starts where consecutive final losses differ by > 3 x noise

# Keys that never change what a run learns; ignored when grouping runs.
BOOKKEEPING = {
    "seed", "train.device", "train.progress", "train.compile", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.keep_checkpoints", "train.log_every",
    "model.vocab_size",  # follows the tokenizer (data.tokenizer), filled in at train time
}
ROPE_AMOUNT = {"model.rope.fraction", "model.rope.rotary_dims"}

COLUMNS = [
    "id", "status", "group", "block", "fraction", "fraction_label", "rotary_dims", "head_dim", "seq_len",
    "dataset", "seed", "lr", "steps", "final_train_loss", "final_val_loss", "band", "spikes",
    "unrecovered_spikes", "tokens", "wall_time_s", "tokens_per_s", "target_loss", "steps_to_target",
    "tokens_to_target", "model", "qk_norm", "nominal_fraction", "error",
]


# ------------------------------------------------------------------------------ reading


@dataclass
class Run:
    """One run directory as read from disk.

    status: ``done`` (result.json), ``failed`` (error.txt), ``incomplete`` (neither: still
    running or killed) or ``invalid`` (no readable config.yaml)."""

    id: str
    path: Path
    status: str
    config: dict = field(default_factory=dict)
    metrics: list = field(default_factory=list)
    result: Optional[dict] = None
    error: Optional[str] = None

    def _column(self, key: str, rows: list) -> np.ndarray:
        return np.array([float(r.get(key, math.nan)) if r.get(key) is not None else math.nan for r in rows])

    @property
    def train_rows(self) -> list:
        return [r for r in self.metrics if "loss" in r]

    @property
    def steps(self) -> np.ndarray:
        return np.array([int(r["step"]) for r in self.train_rows], dtype=np.int64)

    @property
    def losses(self) -> np.ndarray:
        return self._column("loss", self.train_rows)

    @property
    def tokens(self) -> np.ndarray:
        return self._column("tokens", self.train_rows)

    @property
    def val(self) -> tuple[np.ndarray, np.ndarray]:
        rows = [r for r in self.metrics if r.get("val_loss") is not None]
        return np.array([int(r["step"]) for r in rows], dtype=np.int64), self._column("val_loss", rows)


def read_metrics_tolerant(path: Path) -> list[dict]:
    """metrics.jsonl rows, sorted by step; unreadable lines (a crash mid-write) are skipped and
    a step logged twice keeps its last row."""
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            by_step[int(row["step"])] = row
    return [by_step[k] for k in sorted(by_step)]


def collect_runs(study_dir: str | Path) -> list[Run]:
    """Every run directory under ``study_dir/runs/``, sorted by name."""
    runs_dir = Path(study_dir) / "runs"
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"{runs_dir}: no runs folder; expected {Path(study_dir)}/runs/<run_id>/")
    runs = []
    for path in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        run = Run(id=path.name, path=path, status="incomplete")
        cfg_path = path / "config.yaml"
        try:
            run.config = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.is_file() else {}
            if not isinstance(run.config, dict):
                raise yaml.YAMLError("top level is not a mapping")
        except (yaml.YAMLError, OSError) as exc:
            run.config, run.status, run.error = {}, "invalid", f"config.yaml unreadable: {exc}".splitlines()[0]
        run.metrics = read_metrics_tolerant(path / "metrics.jsonl")
        result_path = path / "result.json"
        if result_path.is_file():
            try:
                run.result = json.loads(result_path.read_text())
            except json.JSONDecodeError:
                run.result = None
        error_path = path / "error.txt"
        # a result.json outweighs an error.txt: another attempt (a concurrent run, a re-run) finished the run
        if error_path.is_file() and run.result is None:
            run.status = "failed"
            run.error = error_path.read_text(errors="replace").strip() or "error.txt (empty)"
        elif run.status != "invalid":
            if not cfg_path.is_file():
                run.status, run.error = "invalid", "no config.yaml"
            elif run.result is not None:
                run.status = "done"
        runs.append(run)
    return runs


# ---------------------------------------------------------------------------- summary


def _flatten(tree: Any, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: tree}


def _key(config: dict, drop: set) -> str:
    flat = {k: v for k, v in _flatten(config).items() if k not in drop}
    return json.dumps(flat, sort_keys=True, default=str)


def _normalized(config: dict) -> dict:
    """The config with every default filled in (as training resolved it), so a partial and a
    complete config of the same run compare equal; the raw config when it does not load."""
    import copy

    try:
        return build_run_config(copy.deepcopy(config)).to_dict()
    except Exception:  # an older / newer config layout: compare what is there
        return config


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return default
        node = node[part]
    return node


_MODEL, _DATA, _TRAIN = ModelConfig(), DataConfig(), TrainConfig()


def fraction_label(rotary_dims: int, head_dim: int, nominal: Optional[float] = None) -> str:
    """Short name of a RoPE amount: ``NoPE``, ``2 ch``, ``25%`` (the nominal fraction when known),
    ``full``."""
    if rotary_dims == 0:
        return "NoPE"
    if rotary_dims >= head_dim:
        return "full"
    if rotary_dims == 2:
        return "2 ch"
    if nominal is not None and 0 < nominal < 1:
        return f"{100 * nominal:g}%"
    return f"{100 * rotary_dims / head_dim:.3g}%"


def _finite(x: Any) -> Optional[float]:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _run_facts(cfg: dict) -> dict:
    d_model = int(_get(cfg, "model.d_model", _MODEL.d_model))
    n_head = int(_get(cfg, "model.n_head", _MODEL.n_head))
    head_dim = int(_get(cfg, "model.head_dim", None) or d_model // n_head)
    nominal = float(_get(cfg, "model.rope.fraction", 1.0))
    explicit = _get(cfg, "model.rope.rotary_dims", None)
    rotary_dims = resolve_rotary_dims(head_dim, nominal, explicit)
    return {
        "block": _get(cfg, "model.block", _MODEL.block),
        "model": _get(cfg, "model.name", _MODEL.name),
        "qk_norm": bool(_get(cfg, "model.qk_norm", _MODEL.qk_norm)),
        "head_dim": head_dim,
        "rotary_dims": rotary_dims,
        "fraction": rotary_dims / head_dim,
        "nominal_fraction": nominal if explicit is None else rotary_dims / head_dim,
        "fraction_label": fraction_label(rotary_dims, head_dim, nominal if explicit is None else None),
        "seq_len": int(_get(cfg, "data.seq_len", _DATA.seq_len)),
        "dataset": str(_get(cfg, "data.corpus", _DATA.corpus)),
        "seed": _get(cfg, "seed", 0),
        "lr": _finite(_get(cfg, "train.lr", _TRAIN.lr)),
    }


def _group_labels(keys: dict[str, str]) -> dict[str, str]:
    """Readable name for each comparison-group key: the config values that differ between groups."""
    unique = list(dict.fromkeys(keys.values()))
    if len(unique) == 1:
        return {unique[0]: "all"}
    flats = {k: json.loads(k) for k in unique}
    names = sorted(set().union(*flats.values()))
    varying = [n for n in names if len({json.dumps(f.get(n), default=str) for f in flats.values()}) > 1]
    preferred = ["model.block", "data.seq_len", "data.corpus", "model.qk_norm", "train.lr"]
    varying.sort(key=lambda n: (preferred.index(n) if n in preferred else len(preferred), n))
    short = {"data.corpus": "dataset"}
    labels = {}
    for k, flat in flats.items():
        parts = [f"{short.get(n, n.split('.')[-1])}={flat.get(n, '-')}" for n in varying[:4]]
        labels[k] = ", ".join(parts) + (", ..." if len(varying) > 4 else "")
    return labels


def _spike_kwargs(n: int) -> dict:
    # window: 50 points, fewer for short runs (but enough for a median)
    return {"window": int(min(50, max(10, n // 10)))}


def summarize(
    runs: list[Run],
    target: Optional[float] = None,
    tail_fraction: float = TAIL_FRACTION,
    band_factor: float = BAND_FACTOR,
) -> list[dict]:
    """One row per run (keys: `COLUMNS`), ordered by group, fraction, seed.

    final_train_loss: mean training loss over the last `tail_fraction` of steps.
    final_val_loss: result.json's, else the last logged val_loss.
    band: convergence band inside the run's comparison group (0 = lowest loss), for finished
      runs only; the noise is `analysis.estimate_noise` over all finished runs, with seed
      replicas (runs that differ only by seed) when there are any.
    steps_to_target / tokens_to_target: first step (tokens) where the smoothed training loss
      reaches `target`, or by default the final loss of full RoPE in the same group (mean over
      its seeds); ``target_loss`` says which value was used.
    The study-level facts (noise, its source, threshold) are attached to every row under the
    private key ``_study``, which `write_report` uses and the CSV omits.
    """
    valid = [r for r in runs if r.status != "invalid"]
    configs = {r.id: _normalized(r.config) for r in valid}
    facts = {r.id: _run_facts(configs[r.id]) for r in valid}
    group_key = {r.id: _key(configs[r.id], BOOKKEEPING | ROPE_AMOUNT) for r in valid}
    seed_key = {r.id: _key(configs[r.id], BOOKKEEPING) for r in valid}
    labels = _group_labels(group_key) if valid else {}
    for r in runs:
        if r.status == "invalid":
            facts[r.id], group_key[r.id] = {}, ""
    labels[""] = "—"

    curves = {r.id: (r.steps, r.losses) for r in runs}
    finals = {r.id: analysis.final_loss(*curves[r.id], tail_fraction=tail_fraction) for r in runs}
    done = [r for r in runs if r.status == "done" and math.isfinite(finals[r.id])]

    seed_groups: dict[str, list[str]] = {}
    for r in done:
        seed_groups.setdefault(seed_key[r.id], []).append(r.id)
    noise, source = analysis.estimate_noise(
        {r.id: curves[r.id] for r in done}, list(seed_groups.values()), tail_fraction, return_source=True
    )
    bands: dict[str, Optional[int]] = {}
    targets: dict[str, Optional[float]] = {}
    for key in dict.fromkeys(group_key[r.id] for r in valid):
        members = [r for r in done if group_key[r.id] == key]
        if math.isfinite(noise):
            bands |= analysis.convergence_bands({r.id: finals[r.id] for r in members}, noise, band_factor)
        full = [finals[r.id] for r in members if facts[r.id]["rotary_dims"] >= facts[r.id]["head_dim"]]
        targets[key] = float(target) if target is not None else (float(np.mean(full)) if full else None)

    rows = []
    for r in runs:
        f = facts[r.id]
        steps, losses, tokens = curves[r.id] + (r.tokens,)
        spikes = analysis.detect_spikes(steps, losses, **_spike_kwargs(len(losses))) if len(losses) else []
        res = r.result or {}
        val_steps, val_losses = r.val
        final_val = _finite(res.get("final_val_loss"))
        if final_val is None and len(val_losses):
            final_val = _finite(val_losses[-1])
        tgt = targets.get(group_key[r.id])
        stt = analysis.steps_to_target(steps, losses, tgt) if tgt is not None and len(losses) else None
        tok_to = None
        if stt is not None:
            tok_to = _finite(tokens[int(np.searchsorted(steps, stt))])
        last = r.metrics[-1] if r.metrics else {}
        rows.append({
            "id": r.id,
            "status": r.status,
            "group": labels.get(group_key[r.id], "all"),
            "block": f.get("block"),
            "fraction": f.get("fraction"),
            "fraction_label": f.get("fraction_label"),
            "rotary_dims": f.get("rotary_dims"),
            "head_dim": f.get("head_dim"),
            "seq_len": f.get("seq_len"),
            "dataset": f.get("dataset"),
            "seed": f.get("seed"),
            "lr": f.get("lr"),
            "steps": int(res.get("steps") or (steps[-1] if len(steps) else 0)),
            "final_train_loss": _finite(finals[r.id]),
            "final_val_loss": final_val,
            "band": bands.get(r.id),
            "spikes": len(spikes),
            "unrecovered_spikes": sum(not s.recovered for s in spikes),
            "tokens": int(res.get("tokens") or last.get("tokens") or 0),
            "wall_time_s": _finite(res.get("wall_time_s")),
            "tokens_per_s": _finite(res.get("tokens_per_s"))
            or _finite(np.nanmedian([x.get("tokens_per_s", math.nan) for x in r.metrics]) if r.metrics else None),
            "target_loss": tgt,
            "steps_to_target": stt,
            "tokens_to_target": tok_to,
            "model": f.get("model"),
            "qk_norm": f.get("qk_norm"),
            "nominal_fraction": f.get("nominal_fraction"),
            "error": r.error,
            "spike_list": [s.to_dict() for s in spikes],
            "_study": {"noise": _finite(noise), "noise_source": source, "band_factor": band_factor,
                       "seed_groups": sum(len(g) >= 2 for g in seed_groups.values()),
                       "tail_fraction": tail_fraction, "target": target},
        })
    order = {label: i for i, label in enumerate(sorted(set(labels.values())))}
    rows.sort(key=lambda row: (order.get(row["group"], 0), row["fraction"] if row["fraction"] is not None else -1,
                               str(row["seed"]), row["id"]))
    return rows



# ---------------------------------------------------------------------------- findings


def _replicated(rows: list[dict]) -> set:
    """Fractions that have more than one run (seed replicas) among `rows`."""
    seen: dict = {}
    for r in rows:
        seen[r["fraction"]] = seen.get(r["fraction"], 0) + 1
    return {f for f, n in seen.items() if n > 1}


def _who(row: dict, with_seed: bool) -> str:
    return row["fraction_label"] + (f" s{row['seed']}" if with_seed else "")


def _names(rows: list[dict], replicated: set) -> str:
    return ", ".join(_who(r, r["fraction"] in replicated) for r in rows)


def _spike_text(spike: dict) -> str:
    size = "diverged" if not math.isfinite(spike["loss"]) else f"+{100 * spike['jump']:.0f}%"
    return f"step {spike['step']} {size}" + ("" if spike["recovered"] else " unrecovered")


def findings(rows: list[dict]) -> list[str]:
    """The report's sentences, stated from the data (one string per bullet, Markdown-light:
    only `code` spans)."""
    if not rows:
        return ["No runs found under runs/."]
    study = rows[0]["_study"]
    out = []
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "incomplete", "invalid")}
    out.append(f"{len(rows)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ".")
    noise, factor = study["noise"], study["band_factor"]
    if noise is None:
        out.append("Run-to-run noise could not be estimated (no finished run with enough logged steps), "
                   "so no convergence bands were formed.")
    elif study["noise_source"] == "seeds":
        out.append(f"Noise of the final loss: {noise:.4g}, the pooled standard deviation over "
                   f"{study['seed_groups']} group(s) of seed replicas; a new band starts where sorted final "
                   f"losses differ by more than {factor:g} × noise = {factor * noise:.4g}.")
    else:
        out.append(f"Noise of the final loss: {noise:.4g}, estimated from each run's own loss tail (no seed "
                   f"replicas); this counts batch noise only, a lower bound on seed-to-seed variation, so bands "
                   f"may split runs a second seed would merge. Band threshold {factor:g} × noise = "
                   f"{factor * noise:.4g}.")
    for group in dict.fromkeys(r["group"] for r in rows if r["status"] != "invalid"):
        members = [r for r in rows if r["group"] == group and r["band"] is not None]
        where = "" if group == "all" else f"Group `{group}`: "
        if not members:
            out.append(f"{where}no finished run to compare.")
            continue
        replicated = _replicated(members)
        n_bands = max(r["band"] for r in members) + 1
        desc = []
        for b in range(n_bands):
            inb = sorted((r for r in members if r["band"] == b), key=lambda r: (r["fraction"], str(r["seed"])))
            lo = min(r["final_train_loss"] for r in inb)
            hi = max(r["final_train_loss"] for r in inb)
            span = f"{lo:.4f}" if len(inb) == 1 else f"{lo:.4f}–{hi:.4f}"
            desc.append(f"band {b} ({span}): {_names(inb, replicated)}")
        full = [r for r in members if r["rotary_dims"] >= r["head_dim"]]
        if len(members) == 1:
            out.append(f"{where}only one finished run ({_who(members[0], False)}); no bands to compare.")
        elif n_bands == 1:
            spread = max(r["final_train_loss"] for r in members) - min(r["final_train_loss"] for r in members)
            ratio = f" = {spread / noise:.1f} × noise" if noise else ""
            out.append(f"{where}no separate band found at this scale: all {len(members)} finished runs end within "
                       f"noise of each other (final-loss spread {spread:.4g}{ratio}).")
        else:
            out.append(f"{where}{n_bands} bands — " + "; ".join(desc) + ".")
        if full:
            fb = sorted({r["band"] for r in full})
            full_loss = float(np.mean([r["final_train_loss"] for r in full]))
            sharing = sorted({r["fraction_label"] for r in members if r["band"] in fb and r["rotary_dims"] < r["head_dim"]},
                             key=lambda lab: min(r["fraction"] for r in members if r["fraction_label"] == lab))
            outside = [r for r in members if r["band"] not in fb]
            text = f"{where}full RoPE (final loss {full_loss:.4f}) is in band {', '.join(map(str, fb))}"
            text += f", shared with: {', '.join(sharing)}" if sharing else ", alone (no other fraction shares it)"
            if outside:
                gaps = ", ".join(
                    f"{_who(r, r['fraction'] in replicated)} (band {r['band']}, {r['final_train_loss'] - full_loss:+.4f})"
                    for r in sorted(outside, key=lambda r: r["final_train_loss"]))
                text += f"; outside it: {gaps}"
            out.append(text + ".")
        else:
            out.append(f"{where}no finished full-RoPE run, so no band is named as full RoPE's.")
        reach = [r for r in members if r["target_loss"] is not None]
        if reach:
            tgt = reach[0]["target_loss"]
            what = "the given target" if study["target"] is not None else "full RoPE's final loss"
            parts = [_who(r, r["fraction"] in replicated) + " " + (f"step {r['steps_to_target']}" if r["steps_to_target"] is not None
                                              else "never") for r in reach]
            out.append(f"{where}steps to reach {what} ({tgt:.4f}, smoothed loss): " + "; ".join(parts) + ".")
    spiky = [r for r in rows if r["spikes"]]
    if not spiky:
        out.append("Loss spikes: none found in any run.")
    else:
        total = sum(r["spikes"] for r in spiky)
        unrec = sum(r["unrecovered_spikes"] for r in spiky)
        detail = "; ".join(
            f"`{r['id']}` ({r['fraction_label']}): " + ", ".join(_spike_text(s) for s in r["spike_list"])
            for r in spiky)
        out.append(f"Loss spikes: {total} found in {len(spiky)} run(s), {unrec} unrecovered — {detail}.")
    for r in rows:
        if r["status"] in ("failed", "invalid"):
            first = (r["error"] or "").strip().splitlines()
            out.append(f"Run `{r['id']}` {r['status']}: {first[-1] if first else 'no error text'}")
    return out
