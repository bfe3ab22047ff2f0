"""What a study's summary says about each run from its config: model, RoPE amount and its label,
data, seed, learning rate; and the comparison group it belongs to.

Runs are compared inside *comparison groups*: runs whose configs are equal once the seed, the
RoPE fraction / rotary_dims and bookkeeping keys (device, progress, eval / checkpoint cadence)
are removed; runs whose configs differ only by the seed are seed replicas.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from typing import Any, Optional

from ropelab.config import DataConfig, ModelConfig, TrainConfig, build_run_config, resolve_rotary_dims

__all__ = ["BOOKKEEPING", "ROPE_AMOUNT", "comparison_key", "finite_or_none", "fraction_label", "group_labels",
           "normalized_config", "run_facts"]

# Keys that never change what a run learns; ignored when grouping runs.
BOOKKEEPING = {
    "seed", "train.device", "train.progress", "train.compile", "train.eval_every", "train.eval_batches",
    "train.checkpoint_every", "train.keep_checkpoints", "train.log_every",
    "model.vocab_size",  # follows the tokenizer (data.tokenizer), filled in at train time
}
ROPE_AMOUNT = {"model.rope.fraction", "model.rope.rotary_dims"}

_MODEL, _DATA, _TRAIN = ModelConfig(), DataConfig(), TrainConfig()


def _flatten(tree: Any, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: tree}


def comparison_key(config: dict, drop: set) -> str:
    """The config's dotted keys and values less those in `drop`, as a string: equal for configs that
    are equal but for them (drop `BOOKKEEPING` for seed replicas, and `ROPE_AMOUNT` as well for a
    comparison group)."""
    flat = {k: v for k, v in _flatten(config).items() if k not in drop}
    return json.dumps(flat, sort_keys=True, default=str)


def normalized_config(config: dict) -> dict:
    """The config with every default filled in (as training resolved it), so a partial and a
    complete config of the same run compare equal; the raw config when it does not load."""
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


def finite_or_none(x: Any) -> Optional[float]:
    """`x` as a float when it is a finite number, else None (how the summary writes a missing value)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _kept_pairs(cfg: dict) -> Optional[int]:
    """The frequency pairs a converted run's KV heads keep (the most of any layer and head in its plan,
    `model.rope_layers.<i>.pairs`, or `model.rope.keep_pairs` before the plan is resolved); None for a run
    that rotates by fraction or rotary_dims."""
    layers = _get(cfg, "model.rope_layers", None)
    counts = [len(head) for layer in (layers.values() if isinstance(layers, dict) else [])
              if isinstance(layer, dict) and isinstance(layer.get("pairs"), list)
              for head in layer["pairs"] if isinstance(head, list)]
    if counts:
        return max(counts)
    keep = _get(cfg, "model.rope.keep_pairs", None)
    return keep if isinstance(keep, int) and not isinstance(keep, bool) else None


def run_facts(cfg: dict) -> dict:
    """The summary's columns that come from a run's (normalized) config."""
    d_model = int(_get(cfg, "model.d_model", _MODEL.d_model))
    n_head = int(_get(cfg, "model.n_head", _MODEL.n_head))
    head_dim = int(_get(cfg, "model.head_dim", None) or d_model // n_head)
    nominal = float(_get(cfg, "model.rope.fraction", 1.0))
    explicit = _get(cfg, "model.rope.rotary_dims", None)
    kept = _kept_pairs(cfg)
    if kept is not None:  # a conversion plan rotates the pairs it keeps, whatever the fraction says
        explicit = 2 * kept
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
        "lr": finite_or_none(_get(cfg, "train.lr", _TRAIN.lr)),
    }


_PER_LAYER = re.compile(r"^(model\.(?:rope_layers|position_layers))\.\d+\.(.+)$")


def _per_layer_folded(flat: dict) -> dict:
    """`flat` with each per-layer family (``model.rope_layers.<i>.pairs`` over the layers, as a conversion
    plan resolves them) folded into one key ``model.rope_layers.*.pairs``, valued by a short fingerprint
    of its layers' values: a plan of 30 layers is one entry of a group's name, not 30."""
    folded, families = {}, {}
    for key, value in flat.items():
        match = _PER_LAYER.match(key)
        if match is None:
            folded[key] = value
        else:
            families.setdefault(f"{match[1]}.*.{match[2]}", {})[key] = value
    for family, values in families.items():
        digest = hashlib.sha1(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:6]
        folded[family] = f"{len(values)} layers #{digest}"
    return folded


def group_labels(keys: dict[str, str]) -> dict[str, str]:
    """Readable name for each comparison-group key: the config values that differ between groups. Up to
    four such keys are all named; past four, the fewest that still tell every group apart (taken greedily,
    the layer pattern, block, length, corpus, QK-norm and learning rate first), then "...". Per-layer
    families count as one key (`_per_layer_folded`)."""
    unique = list(dict.fromkeys(keys.values()))
    if len(unique) == 1:
        return {unique[0]: "all"}
    flats = {k: _per_layer_folded(json.loads(k)) for k in unique}
    names = sorted(set().union(*flats.values()))
    varying = [n for n in names if len({json.dumps(f.get(n), default=str) for f in flats.values()}) > 1]
    preferred = ["model.layer_pattern", "model.block", "data.seq_len", "data.corpus", "model.qk_norm", "train.lr"]
    varying.sort(key=lambda n: (preferred.index(n) if n in preferred else len(preferred), n))
    last_parts = [n.split(".")[-1] for n in varying]
    # the last part names a key unless two varying keys share it (a layer kind's `attention`, say)
    short = {n: n.split(".", 1)[-1] if last_parts.count(n.split(".")[-1]) > 1 else n.split(".")[-1] for n in varying}
    short["data.corpus"] = "dataset"

    def values(flat: dict, chosen: list[str]) -> tuple:
        return tuple(json.dumps(flat.get(n), default=str) for n in chosen)

    def distinct(chosen: list[str]) -> int:
        return len({values(flat, chosen) for flat in flats.values()})

    chosen = varying
    if len(varying) > 4:
        chosen = []
        while distinct(chosen) < len(flats) and len(chosen) < len(varying):
            best = max((n for n in varying if n not in chosen), key=lambda n: distinct(chosen + [n]))
            chosen.append(best)
        chosen.sort(key=varying.index)
    more = ", ..." if len(chosen) < len(varying) else ""
    return {k: ", ".join(f"{short[n]}={flat.get(n, '-')}" for n in chosen) + more for k, flat in flats.items()}
