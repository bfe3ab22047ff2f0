"""The probe's HTML page: the input, per mode the distance lines, a side-by-side metrics table and
the heatmaps, and the weight updates. Figures are linked as the PNG files next to the page."""

from __future__ import annotations

import html
import math
from typing import Any, Optional

from ropelab.probe.analysis import split_name

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1400px;
       color: #222; padding: 0 1em; line-height: 1.45; }
h1 { font-size: 1.5em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
code, pre { background: #f2f2f2; border-radius: 3px; } pre { padding: .6em; white-space: pre-wrap; max-height: 12em; overflow: auto; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #666; font-size: .85em; }
table { border-collapse: collapse; font-size: .82em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: .25em .5em; text-align: right; white-space: nowrap; }
th { background: #333; color: #fff; } td:first-child { text-align: left; }
details { margin: .5em 0; }
"""

# (metrics key, column title) shown per checkpoint in the mode tables
TABLE_METRICS = [
    ("mean_relative_l2", "mean rel. L2"), ("mean_cosine_distance", "mean cos. dist."),
    ("variance_rotated", "var. rotated"), ("variance_unrotated", "var. unrotated"), ("mean_kl", "mean KL"),
]


def fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def figure(src: str, caption: str) -> str:
    return f'<figure><img alt="{html.escape(caption)}" src="{html.escape(src)}"><figcaption>{html.escape(caption)}</figcaption></figure>'


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


def input_section(meta: dict) -> str:
    probe = meta["input"]
    rows = [
        ("checkpoints", ", ".join(f"{c['label']} ({c['source']})" for c in meta["checkpoints"])),
        ("sequence", f"{probe['repeats']} repeats of {probe['block_len']} tokens (BOS id {probe['bos_id']}, "
                     f"{probe['block_len'] - 2} content tokens, EOS id {probe['eos_id']}) = {probe['window']:,} tokens"),
        ("analysed tokens", f"position {probe['analysis_position_in_block']} of every repeat (the token before EOS)"),
        ("content", probe["source"]), ("modes", ", ".join(meta["modes"])), ("layers", ", ".join(map(str, meta["layers"]))),
        ("stages", ", ".join(meta["stages"])),
    ]
    table = "".join(f"<tr><td>{html.escape(k)}</td><td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{table}</table><details><summary>input text</summary><pre>{html.escape(probe['text'])}</pre></details>"


def comparison_table(comparison: dict, labels: list[str]) -> str:
    """Rows: capture names; columns: each metric for each checkpoint, then its difference from the first."""
    head = "<th>capture</th>" + "".join(
        f"<th>{html.escape(title)}<br>{html.escape(label)}</th>" for _, title in TABLE_METRICS for label in labels
    ) + "".join(f"<th>Δ {html.escape(title)}<br>{html.escape(label)} − {html.escape(labels[0])}</th>"
                for _, title in TABLE_METRICS[:1] + TABLE_METRICS[-1:] for label in labels[1:])
    body = []
    for name, entry in comparison.items():
        cells = [f"<td>{html.escape(name)}</td>"]
        cells += [f"<td>{fmt(entry['values'][label].get(key))}</td>" for key, _ in TABLE_METRICS for label in labels]
        cells += [f"<td>{fmt(entry['difference'][label].get(key))}</td>"
                  for key, _ in TABLE_METRICS[:1] + TABLE_METRICS[-1:] for label in labels[1:]]
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def mode_section(mode: str, comparison: dict, labels: list[str], lines_src: str, heatmaps: dict[str, str]) -> str:
    """heatmaps: {checkpoint label: png path}."""
    parts = [f"<h2>mode {html.escape(mode)}</h2>", figure(lines_src, f"distance to the first repeat against position, {mode}"),
             comparison_table(comparison, labels)]
    for label, src in heatmaps.items():
        parts.append(f"<details><summary>heatmaps (channel x repeat) of {html.escape(label)}</summary>"
                     f"{figure(src, f'{label}, {mode}: a row per stage')}</details>")
    return "\n".join(parts)


def _moved(a: Any, b: Any) -> str:
    """`a`, or ``a → b`` where a plan moved it (a span's rows, a layer's rotated channels, in A and in B)."""
    return html.escape(str(a) if b is None or b == a else f"{a} → {b}")


def weights_section(changes: dict, labels: tuple[str, str], image_src: str) -> str:
    a, b = labels
    layer_rows = "".join(
        f"<tr><td>{e['layer']}</td><td>{_moved(e['rotary_dims'], e.get('rotary_dims_b'))} ({e['layout']})</td><td>{fmt(e['theta_a'])} → {fmt(e['theta_b'])}</td>"
        f"<td>{fmt(e['q']['relative_change'])}</td><td>{fmt(e['q']['unrotated'])}</td>"
        f"<td>{fmt(e['k']['relative_change'])}</td><td>{fmt(e['k']['unrotated'])}</td></tr>"
        for e in changes["layers"]
    )
    span_rows = "".join(
        f"<tr><td>{s['layer']}</td><td>W_{s['proj']}</td><td>{s['head']}</td><td>{html.escape(s['span'])}</td>"
        f"<td>{_moved(', '.join(map(str, s['rows'])), ', '.join(map(str, s.get('rows_b', s['rows']))))}</td><td>{fmt(s['wavelength_tokens'])}</td><td>{fmt(s['relative_change'])}</td></tr>"
        for s in changes["top_spans"]
    )
    return (
        f"<h2>weight updates {html.escape(a)} → {html.escape(b)}</h2>"
        f"<p>Relative change ||W_{html.escape(b)} − W_{html.escape(a)}|| / ||W_{html.escape(a)}|| of the query and key "
        "projections, over the output rows of each span (frequency pairs mapped through each layer's layout; in a "
        "layer with a RoPE plan, each source pair's rows in either checkpoint, and the dropped pairs as unrotated).</p>"
        + figure(image_src, f"weight change, layer x frequency pair: {a} → {b}")
        + "<table><thead><tr><th>layer</th><th>rotary dims</th><th>theta</th><th>W_q</th><th>W_q unrotated</th>"
        f"<th>W_k</th><th>W_k unrotated</th></tr></thead><tbody>{layer_rows}</tbody></table>"
        "<h3>spans that changed most</h3><table><thead><tr><th>layer</th><th>proj.</th><th>head</th><th>span</th>"
        f"<th>rows</th><th>wavelength (tokens)</th><th>rel. change</th></tr></thead><tbody>{span_rows}</tbody></table>"
    )


def findings(comparison_by_mode: dict[str, dict], labels: list[str]) -> list[str]:
    """One sentence per mode and checkpoint: where the perturbation is largest, and what reaches the logits."""
    out = []
    for mode, comparison in comparison_by_mode.items():
        for label in labels:
            ranked = [(entry["values"][label].get("mean_relative_l2"), name) for name, entry in comparison.items()
                      if split_name(name)[0] not in ("q_post", "k_post")]  # post-RoPE rows rotate by design
            ranked = [(v, n) for v, n in ranked if v is not None and math.isfinite(v)]
            if not ranked:
                continue
            value, name = max(ranked)
            kl: Optional[float] = comparison.get("logits", {}).get("values", {}).get(label, {}).get("mean_kl")
            if value == 0.0:
                text = f"{mode}, {label}: every repeat identical to the first at every stage (outside post-RoPE q/k)"
            else:
                text = f"{mode}, {label}: largest mean relative L2 (outside post-RoPE q/k) at {name} = {fmt(value)}"
            out.append(text + (f"; mean KL of the next-token distribution to the first repeat = {fmt(kl)} nats" if kl is not None else ""))
    return out
