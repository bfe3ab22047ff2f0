"""The way through `load` is short: the kind of a source is decided once (`locate`), then one loader
reads it, so no module of ropelab.sources is entered twice in one call. (A GGUF source takes the same
way, through its imported folder; the real file takes minutes to import, so it is not traced here.)"""

from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropelab.config import build_run_config  # noqa: E402
from ropelab.export.hf import export_hf  # noqa: E402
from ropelab.model import Transformer  # noqa: E402
from ropelab.sources import import_model, load  # noqa: E402
from ropelab.sources.imported import save_weights_only  # noqa: E402

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64", "model.vocab_size=320",
        "data.tokenizer=bytes", "data.seq_len=16"]


def entered(name) -> list[str]:
    """The modules of ropelab.sources that `load(name)` enters (one of their functions called from
    outside them), in order, consecutive repeats collapsed."""
    modules: list[str] = []

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if event == "call" and module.startswith("ropelab.sources.") and caller != module:
            if not modules or modules[-1] != module:
                modules.append(module)

    sys.setprofile(profile)
    try:
        load(name)
    finally:
        sys.setprofile(None)
    return [module.removeprefix("ropelab.sources.") for module in modules]


def write_run(run_dir, *overrides):
    config = build_run_config(overrides=[*TINY, *overrides])
    torch.manual_seed(0)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    return save_weights_only(run_dir, 3, Transformer(config.model), config)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sources")
    checkpoint = write_run(root / "run")
    write_run(root / "nope", "model.rope.fraction=0.0")
    export_hf(root / "nope", root / "export")  # no native transformers class: ropelab's own modeling code
    hf_config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(root / "hf")
    import_model(str(root / "hf"), root / "imported")
    return {"run": root / "run", "checkpoint": checkpoint, "imported": root / "imported", "hf": root / "hf",
            "export": root / "export"}


@pytest.mark.parametrize("kind, path", [
    ("run", ["loading", "locate", "runs"]),
    ("checkpoint", ["loading", "locate", "runs"]),
    ("imported", ["loading", "locate", "runs"]),
    ("export", ["loading", "locate", "runs", "exported", "hf_models", "imported"]),
    ("hf", ["loading", "locate", "runs", "exported", "hf_models", "transformers_lib", "hf", "hf_config_read",
            "imported"]),
])
def test_each_module_is_entered_once(sources, kind, path):
    assert entered(sources[kind]) == path


def test_callers_importing_one_gguf_file_at_once_convert_it_once(tmp_path, monkeypatch):
    """Two jobs of a cluster on one cache: the second waits for the first's import and reads it."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ropelab.config import ModelConfig
    from ropelab.sources import cached_import, loading
    from ropelab.sources.hf_models import Converted
    from ropelab.sources.locate import Source

    monkeypatch.setenv("ROPELAB_CACHE", str(tmp_path / "cache"))
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    converting = []

    def slow_conversion(source):
        converting.append(threading.get_ident())
        time.sleep(0.5)  # both callers have looked for the folder by now
        model = Transformer(ModelConfig(vocab_size=320, n_layer=1, d_model=32, n_head=2, d_ff=64))
        return Converted(model, "LlamaForCausalLM", "bytes", "byte-level")

    monkeypatch.setattr(loading, "_converted", slow_conversion)
    source = Source("model.gguf", "gguf", str(file))
    with ThreadPoolExecutor(2) as pool:  # flock excludes two open() of one file, threads or processes alike
        first, second = pool.map(lambda _: cached_import(source), range(2))
    assert len(converting) == 1 and first.checkpoint == second.checkpoint and first.checkpoint.is_dir()
    assert sorted(p.name for p in first.run_dir.parent.iterdir()) == [f".{first.run_dir.name}.lock", first.run_dir.name]
