"""Hugging Face folders for any ropelab model: ropelab's own modeling code shipped with the weights.

Configurations without an exactly equivalent transformers class (NoPE, partial RoPE on Llama-style
blocks, interleaved pairs, truncate frequencies, per-layer RoPE, QK-norm on parallel blocks, ...) are
exported the way the ecosystem ships custom architectures: the folder carries Python modules and a
config.json whose ``auto_map`` names them, so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

builds ropelab's own `Transformer` and computes the same logits. ropelab itself reads such a folder
with its own classes (`ropelab.sources.exported`: `ropelab import`, `ropelab.load`, a teacher), so it
needs no trust_remote_code and never runs the shipped files.

One source of truth: the modules are not a second implementation but whole copies, made at export
time, of the installed ropelab modules that ``modeling_ropelab.py`` (the transformers wrapper,
`MODELING_SOURCE` below, itself written as a ropelab module) imports, directly or through each other:
``model.py``, ``attention.py``, ``layers.py`` (with its CPU loops, ``layer_kernels.py`` and ``native.py``),
``errors.py``, the model's part of ``ropelab.config``
(``config/model.py``, ``config/rope.py``, ``config/coerce.py``, ``config/checks.py``: no YAML, no
run-level settings) and the rope modules ``RotaryEmbedding`` uses. They are found by following the
``from ropelab.<module> import`` lines of each file (`shipped_modules`).

Transformers loads remote code from one flat folder (a shipped file's relative imports must name
files beside it), so each module is written flat next to ``modeling_ropelab.py``, named by its path
in the package with dots as underscores (``ropelab.rope.embedding`` -> ``rope_embedding.py``,
``ropelab.model`` -> ``model.py``), and every ``from ropelab.a.b import`` line becomes
``from .a_b import``. A shipped module therefore imports each name from the module that defines it,
never from a package's ``__init__`` (``from ropelab.config.model import ModelConfig``, not ``from
ropelab.config import ModelConfig``): the export refuses one that does not, and ``import ropelab...``
statements too. Modules imported by name at run time and not by an import statement (the Triton
kernel, see `ropelab.rope.kernels.triton_kernels`) are not shipped: the exported model does without.

The wrapper, ``modeling_ropelab.py``:

  RopelabConfig(PretrainedConfig)    model_type "ropelab"; ``ropelab`` holds the ModelConfig as a dict
                                     (the HF fields hidden_size, num_hidden_layers, ... are derived)
  RopelabForCausalLM(PreTrainedModel, GenerationMixin)
                                     ``model``: the ropelab Transformer, so weights are stored as
                                     ``model.<ropelab name>`` (``model.lm_head.weight`` left out when
                                     tied); generate() keeps a transformers key/value cache
                                     (DynamicCache) that ropelab's attention appends to; a 2-D
                                     attention_mask with padding becomes ropelab document ids (a token
                                     sees only earlier unmasked tokens), positions count from each
                                     row's first unmasked token and so do chunked layers' chunks,
                                     as in transformers' own chunked mask

This module:

  shipped_modules()    {file name: ropelab module} of the shipped modules
  files_for_export()   {file name: text} of the shipped files, modeling_ropelab.py included
  write_remote_code(folder)
  to_remote_hf(model)  the wrapper holding `model`'s tensors (shared, not copied), eval mode, with
                       config.auto_map set; `save_pretrained` it, then `write_remote_code` the folder
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import torch

from ropelab import __version__
from ropelab.config import ConfigError, ModelConfig
from ropelab.model import Transformer

MODELING = "modeling_ropelab"
AUTO_MAP = {
    "AutoConfig": f"{MODELING}.RopelabConfig",
    "AutoModelForCausalLM": f"{MODELING}.RopelabForCausalLM",
}
_FROM_ROPELAB = re.compile(r"^(\s*)from ropelab\.([\w.]+) import ", re.MULTILINE)
_ANY_ROPELAB_IMPORT = re.compile(r"^\s*(from\s+ropelab\b|import\s+ropelab\b)", re.MULTILINE)

# The transformers wrapper, written as a module of the ropelab package (its imports are rewritten
# like those of the copied modules).
MODELING_SOURCE = '''"""Hugging Face wrapper around ropelab's Transformer (load with trust_remote_code=True).

RopelabConfig.ropelab holds the ropelab ModelConfig as a dict; RopelabForCausalLM.model is the
ropelab Transformer. generate() keeps a key/value cache: a transformers DynamicCache, passed to the
Transformer as its `kv_cache`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ropelab.attention import Documents
from ropelab.config.coerce import from_dict
from ropelab.config.model import ModelConfig
from ropelab.model import Transformer
from ropelab.position.registry import rebuild_after_meta

_V4 = int(__import__("transformers").__version__.split(".")[0]) < 5
# The output field of the cache: `cache` in transformers 5.x releases that renamed `past_key_values`.
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def model_config(data: dict) -> ModelConfig:
    """The ropelab ModelConfig stored in RopelabConfig.ropelab (validated)."""
    config = from_dict(ModelConfig, dict(data), "ropelab")
    config.validate()
    return config


class RopelabConfig(PretrainedConfig):
    model_type = "ropelab"

    def __init__(self, ropelab: Optional[dict] = None, **kwargs):
        self.ropelab = dict(ropelab or {})
        derived = {}
        if self.ropelab:
            c = model_config(self.ropelab)
            derived = {
                "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layer,
                "num_attention_heads": c.n_head, "num_key_value_heads": c.kv_heads, "head_dim": c.head_size,
                "intermediate_size": c.d_ff, "max_position_embeddings": c.max_seq_len,
                "initializer_range": c.init_std, "tie_word_embeddings": c.tie_embeddings,
            }
        for key in derived:  # informative copies for transformers tooling: `ropelab` decides
            kwargs.pop(key, None)
        super().__init__(**kwargs)
        for key, value in derived.items():
            setattr(self, key, value)


class RopelabForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = RopelabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = ["model.lm_head.weight"] if _V4 else {"model.lm_head.weight": "model.embed.weight"}
    _supports_cache_class = True  # transformers 4.x: generate() may build a DynamicCache

    def __init__(self, config: RopelabConfig):
        super().__init__(config)
        self.model = Transformer(model_config(config.ropelab))
        # dense: a padded attention_mask becomes document ids, honoured exactly; no mask still uses SDPA.
        self.model.set_attention_backend("dense")
        self._rebuild_rope()
        self.post_init()

    def _rebuild_rope(self) -> None:
        """RoPE frequencies are plain tensors, not weights: from_pretrained builds the model on the meta
        device, so compute them again on the CPU (they follow the positions' device when used), and so
        are the position encodings' buffers (ALiBi's slopes)."""
        with torch.device("cpu"):
            for rope in self.model.ropes:
                rope.set_theta(rope.theta)
            rebuild_after_meta(self.model)

    def _init_weights(self, module):
        """from_pretrained fills the buffers no checkpoint holds with uninitialised memory and then asks
        here for their values: a position encoding's (ALiBi's slopes) are computed again."""
        if hasattr(module, "rebuild_after_meta"):
            module.rebuild_after_meta()
        else:
            super()._init_weights(module)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache=None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        past_key_values=None,
        **kwargs,
    ):
        """`cache` (`past_key_values` in transformers before 5.x): a Cache holding the keys and values of
        the tokens before `input_ids`, appended to here; `attention_mask` then covers those tokens too.
        `use_cache=True` without one starts a DynamicCache. The output carries it (None without)."""
        if input_ids is None:
            raise ValueError("RopelabForCausalLM needs input_ids (inputs_embeds are not supported)")
        cache = cache if cache is not None else past_key_values
        if getattr(cache, "is_compileable", False):  # a StaticCache: its keys are all its slots, filled or not
            raise ValueError("RopelabForCausalLM takes dynamic key/value caches only, not static ones")
        if use_cache and cache is None:
            cache = DynamicCache()
        doc_ids = None
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.bool().all()):
            mask = attention_mask.long()  # as document ids: padding and tokens never attend to each other
            real_so_far = mask.cumsum(-1)
            if position_ids is None:
                position_ids = (real_so_far - 1).clamp(min=0)[:, -input_ids.shape[1]:]
            # a left-padded row's chunks begin at its first token, as transformers' chunked mask counts them
            doc_ids = Documents(mask, chunk_start=(real_so_far == 0).sum(-1))
        logits, _ = self.model(input_ids, position_ids=position_ids, doc_ids=doc_ids, kv_cache=cache)
        loss = None
        if labels is not None:  # next-token loss, labels aligned with input_ids as in transformers
            loss = F.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        if return_dict is False:
            return tuple(x for x in (loss, logits, cache) if x is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE: cache})
'''


# ------------------------------------------------------------------ sources


def _source(module: str) -> str:
    spec = importlib.util.find_spec(f"ropelab.{module}")
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise RuntimeError(f"ropelab.{module}: no Python source to ship with the export")
    if spec.submodule_search_locations is not None:
        raise RuntimeError(f"ropelab.{module} is a package: a shipped module imports each name from the module "
                           f"that defines it (e.g. ropelab.{module}.<module>), not from the package")
    return Path(spec.origin).read_text(encoding="utf-8")


def _ropelab_imports(source: str) -> set[str]:
    """The ropelab modules (``rope.embedding`` for ``ropelab.rope.embedding``) that `source` imports from."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ropelab."):
            found.add(node.module[len("ropelab."):])
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ropelab" for a in node.names):
            raise RuntimeError("`import ropelab...` cannot be shipped; use `from ropelab.X import name`")
    return found


def _flat_name(module: str) -> str:
    """The shipped file's module name: its path in the package, dots as underscores."""
    return module.replace(".", "_")


def shipped_modules() -> dict[str, str]:
    """{file name: ropelab module, e.g. "rope_embedding.py": "rope.embedding"} of every module that
    modeling_ropelab.py imports from, directly or through another shipped module."""
    modules: set[str] = set()
    pending = [MODELING_SOURCE]
    while pending:
        for module in _ropelab_imports(pending.pop()) - modules:
            modules.add(module)
            pending.append(_source(module))
    files = {f"{_flat_name(module)}.py": module for module in sorted(modules)}
    if len(files) != len(modules) or f"{MODELING}.py" in files:
        raise RuntimeError(f"ropelab modules {sorted(modules)}: two would be shipped under one file name")
    return files


def _relative(text: str, name: str) -> str:
    text = _FROM_ROPELAB.sub(lambda m: f"{m.group(1)}from .{_flat_name(m.group(2))} import ", text)
    if _ANY_ROPELAB_IMPORT.search(text):
        raise RuntimeError(f"{name}: an import of ropelab that cannot be rewritten as a relative import")
    return text


def files_for_export() -> dict[str, str]:
    """{file name: text}: modeling_ropelab.py and the ropelab modules it needs, with relative imports."""
    banner = "# Generated by ropelab {} from {} for trust_remote_code loading; do not edit.\n"
    origin = "ropelab/export/remote_code.py (MODELING_SOURCE)"
    files = {f"{MODELING}.py": banner.format(__version__, origin) + MODELING_SOURCE}
    for name, module in shipped_modules().items():
        path = f"ropelab/{module.replace('.', '/')}.py"
        files[name] = banner.format(__version__, path) + _source(module)
    return {name: _relative(text, name) for name, text in files.items()}


def write_remote_code(folder: str | Path) -> list[str]:
    """Write the modeling code next to a saved model's config.json; returns the file names."""
    files = files_for_export()
    for name, text in files.items():
        (Path(folder) / name).write_text(text, encoding="utf-8")
    return sorted(files)


# ------------------------------------------------------------------ the wrapper, in this process

_LOADED: dict[str, object] = {}


def _modeling_module():
    """The shipped modeling_ropelab module, imported here from a temporary copy of the very files
    written into exports (a uniquely named package; once per process and version of the sources)."""
    files = files_for_export()
    digest = hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in sorted(files.items())).encode()).hexdigest()[:16]
    if digest in _LOADED:
        return _LOADED[digest]
    package = f"_ropelab_remote_{digest}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / package
        root.mkdir()
        (root / "__init__.py").write_text("")
        for name, text in files.items():
            (root / name).write_text(text, encoding="utf-8")
        spec = importlib.util.spec_from_file_location(
            package, root / "__init__.py", submodule_search_locations=[str(root)]
        )
        sys.modules[package] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[package])
        try:
            module = importlib.import_module(f"{package}.{MODELING}")
        except Exception:
            for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
                del sys.modules[key]
            raise
    _LOADED[digest] = module
    return module


def check_shipped_positions(config: ModelConfig) -> None:
    """ConfigError (one line) where a layer uses a position type registered outside ropelab: the shipped
    modeling code carries ropelab's own registry, in which that type does not exist."""
    for layer in range(config.n_layer):
        for entry in config.positions_for_layer(layer):
            origin = entry.type.spec.__module__
            if not origin.startswith("ropelab."):
                raise ConfigError(f"{entry.key}: position type {entry.type.name!r} (layer {layer}) is registered in "
                                  f"{origin}, outside ropelab; the exported modeling code knows ropelab's own types "
                                  "only, so this model cannot be exported")


def to_remote_hf(model: Transformer):
    """RopelabForCausalLM (the shipped code) holding `model`'s parameters, shared not copied; eval mode.
    Its config carries `auto_map`, so `save_pretrained` writes a config.json that AutoConfig and
    AutoModelForCausalLM resolve to the modules `write_remote_code` puts beside it."""
    check_shipped_positions(model.config)
    module = _modeling_module()
    config = module.RopelabConfig(ropelab=dataclasses.asdict(model.config), auto_map=dict(AUTO_MAP))
    with torch.device("meta"):  # no allocation or random init: the tensors come from `model`
        hf_model = module.RopelabForCausalLM(config)
    hf_model.model.load_state_dict(model.state_dict(), strict=True, assign=True)
    return hf_model.eval()


__all__ = ["AUTO_MAP", "MODELING", "check_shipped_positions", "files_for_export", "shipped_modules", "write_remote_code", "to_remote_hf"]
