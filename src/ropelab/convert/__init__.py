"""Partial RoPE for pretrained models: keep some frequency pairs per KV head, convert a checkpoint.

  convert_model(source, out_dir, overrides)   `ropelab convert` (see `ropelab.convert.run`)

The plan and the permuted weights (`ropelab.sources.plans`) and the 2-norm calibration
(`ropelab.sources.calibrate`) live with the model sources: `train.init_from` a full-RoPE source
with a plan in `model.rope` converts at the start of the run the same way. Recovery is ordinary
training from the converted folder, with the source as `distill.teacher` (KD) or without (CE).
"""

from ropelab.convert.config import ConvertConfig, convert_config
from ropelab.convert.run import convert_model

__all__ = ["convert_model", "ConvertConfig", "convert_config"]
