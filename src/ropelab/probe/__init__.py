"""Dissect positional information: the repeated-block probe and weight updates between checkpoints.

The distillation seed (Huber et al. 2026, "Short Data, Long Context", Sec. 4) isolates position
from content by repeating one block, BOS + text + EOS, to fill the window: the repeats differ
only in where they sit. The probe runs that sequence through one or more checkpoints, records
every stage of the forward pass at the token before each EOS, and measures how far each
repeat's vector has moved from the first one's.

  sequence   the probe sequence from real text; ids, positions, document ids, analysis positions
  capture    forward hooks that keep only the analysis positions, streamed into safetensors
  metrics    cosine / relative-L2 distance to the first repeat, variance across repeats, KL of logits
  analysis   metrics of a captures file; checkpoints side by side
  channels   query/key channels -> RoPE frequency pairs, for the layout a layer uses
  weights    change of W_q and W_k per layer, head and frequency pair
  plots, report   the figures and the HTML page
  runner     `run_probe` and `weight_updates`, which write the output folders
  cost       the memory a probe needs, by formula

Modes separate the causes of perturbation (see `ProbeMode`): attention across repeats or only
within one, fp32 or bf16, positions running across the window or restarting per repeat. With
the document mask and restarting positions every repeat computes exactly the same thing.
"""

from ropelab.probe.config import ALL_MODES, ProbeConfig, ProbeMode, parse_layers, parse_modes, parse_stages
from ropelab.probe.cost import memory_estimate


def __getattr__(name: str):
    # the runner imports torch, the model and the plotting stack: only when it is asked for, so that the
    # command line reads the probe's options (ropelab.probe.config) in a fraction of a second
    if name in ("run_probe", "weight_updates"):
        from ropelab.probe import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ALL_MODES", "ProbeConfig", "ProbeMode", "parse_layers", "parse_modes", "parse_stages", "memory_estimate",
    "run_probe", "weight_updates",
]
