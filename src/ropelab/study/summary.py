"""Study summary: every run of a study (`ropelab.study.run_folders`) reduced to one row per run,
plus the findings stated from those rows.

Runs are compared inside their comparison groups (`ropelab.study.run_facts`). Convergence bands and
the steps-to-target reference (full RoPE's final loss) are computed per group; the noise that sets
the band threshold is pooled over the whole study.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ropelab.study import analysis
from ropelab.study.run_facts import (BOOKKEEPING, ROPE_AMOUNT, comparison_key, finite_or_none, group_labels,
                                     normalized_config, run_facts)
from ropelab.study.run_folders import Run

__all__ = ["summarize", "findings", "replicated_fractions", "COLUMNS", "TAIL_FRACTION", "BAND_FACTOR"]

TAIL_FRACTION = 0.1  # final loss = mean over the last 10 % of steps
BAND_FACTOR = 3.0  # a new band starts where consecutive final losses differ by > 3 x noise

COLUMNS = [
    "id", "status", "group", "block", "fraction", "fraction_label", "rotary_dims", "head_dim", "seq_len",
    "dataset", "seed", "lr", "steps", "final_train_loss", "final_val_loss", "band", "spikes",
    "unrecovered_spikes", "tokens", "data_passes", "wall_time_s", "tokens_per_s", "target_loss", "steps_to_target",
    "tokens_to_target", "model", "qk_norm", "nominal_fraction", "error",
]


# ---------------------------------------------------------------------------- summary


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
    configs = {r.id: normalized_config(r.config) for r in valid}
    facts = {r.id: run_facts(configs[r.id]) for r in valid}
    group_key = {r.id: comparison_key(configs[r.id], BOOKKEEPING | ROPE_AMOUNT) for r in valid}
    seed_key = {r.id: comparison_key(configs[r.id], BOOKKEEPING) for r in valid}
    labels = group_labels(group_key) if valid else {}
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
        final_val = finite_or_none(res.get("final_val_loss"))
        if final_val is None and len(val_losses):
            final_val = finite_or_none(val_losses[-1])
        tgt = targets.get(group_key[r.id])
        stt = analysis.steps_to_target(steps, losses, tgt) if tgt is not None and len(losses) else None
        tok_to = None
        if stt is not None:
            tok_to = finite_or_none(tokens[int(np.searchsorted(steps, stt))])
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
            "final_train_loss": finite_or_none(finals[r.id]),
            "final_val_loss": final_val,
            "band": bands.get(r.id),
            "spikes": len(spikes),
            "unrecovered_spikes": sum(not s.recovered for s in spikes),
            "tokens": int(res.get("tokens") or last.get("tokens") or 0),
            "data_passes": finite_or_none(res.get("data_passes")),  # runs trained before ropelab recorded it: None
            "wall_time_s": finite_or_none(res.get("wall_time_s")),
            "tokens_per_s": finite_or_none(res.get("tokens_per_s"))
            or finite_or_none(np.nanmedian([x.get("tokens_per_s", math.nan) for x in r.metrics]) if r.metrics else None),
            "target_loss": tgt,
            "steps_to_target": stt,
            "tokens_to_target": tok_to,
            "model": f.get("model"),
            "qk_norm": f.get("qk_norm"),
            "nominal_fraction": f.get("nominal_fraction"),
            "error": r.error,
            "spike_list": [s.to_dict() for s in spikes],
            "_study": {"noise": finite_or_none(noise), "noise_source": source, "band_factor": band_factor,
                       "seed_groups": sum(len(g) >= 2 for g in seed_groups.values()),
                       "tail_fraction": tail_fraction, "target": target},
        })
    order = {label: i for i, label in enumerate(sorted(set(labels.values())))}
    rows.sort(key=lambda row: (order.get(row["group"], 0), row["fraction"] if row["fraction"] is not None else -1,
                               str(row["seed"]), row["id"]))
    return rows


# ---------------------------------------------------------------------------- findings


def replicated_fractions(rows: list[dict]) -> set:
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
        replicated = replicated_fractions(members)
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
