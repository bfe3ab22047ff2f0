"""Where a model comes from: the one place that knows runs, checkpoints, imported folders, Hugging
Face folders and hub names (folders ropelab exported among them), and GGUF files.

  resolve(name) -> Source            what `name` is (`ropelab.sources.locate`), no weights read
  load(name) -> (model, tokenizer, config)
                                     the model in fp32 eval mode on the CPU, the tokenizer its tokens
                                     come from, and its run configuration (for a checkpoint of a
                                     multi-phase run, that phase's); also ``ropelab.load``
  load_config(name) -> (config, Source)
                                     the configuration alone
  import_model(name, out_dir)        a ropelab folder from an HF or GGUF model (`ropelab import`)

resolve, load, load_config and import_model take `trust_remote_code` (default False): whether
transformers may run Python code shipped with a Hugging Face model, its config or its tokenizer.
ropelab's own exports need no such permission: they are read with ropelab's classes.

  run_config(base, preset, overrides) a run config; with `train.init_from`, the source's model
                                     settings and tokenizer are the defaults (`ropelab.sources.init`)

Submodules: runs (the run-directory layout), locate (kinds of source, decided once), loading (one
loader per kind: load, load_config, import_model), hf (the weight adapter; hf_archs, hf_config_read and
hf_config_write: the architectures and their configs; hf_round_trip: a native export only where the
config written reads back as the same model), hf_models (loading with transformers), exported
(folders ropelab exported with its own modeling code), gguf_files (built-in names and GGUF files), gguf
(reading GGUF files), imported (import folders), init (runs that start from a source's weights).
"""

from ropelab.sources.init import check_init, distance_to_source, initial_weights, run_config
from ropelab.sources.loading import Loaded, cached_import, import_model, load, load_config
from ropelab.sources.locate import Source, resolve

__all__ = ["Loaded", "Source", "resolve", "load", "load_config", "import_model", "cached_import", "run_config",
           "check_init", "initial_weights", "distance_to_source"]
