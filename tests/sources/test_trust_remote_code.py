"""No Python code from a model or tokenizer folder runs unless the user asks: code planted in `auto_map`
stays unrun whatever standard input holds, and ropelab's own exports load without the flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ropelab.cli import main  # noqa: E402
from ropelab.config import ModelConfig, RopeConfig  # noqa: E402
from ropelab.export.hf import save_hf  # noqa: E402
from ropelab.model import Transformer  # noqa: E402
from ropelab.sources import load, resolve  # noqa: E402

PLANTED = ("config", "model", "tokenizer")
PLANTED_MODULE = '''import pathlib
pathlib.Path({marker!r}).write_text("ran")  # the proof that this file was imported
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast


class PlantedConfig(PretrainedConfig):
    model_type = "planted"


class PlantedModel(PreTrainedModel):
    config_class = PlantedConfig


class PlantedTokenizer(PreTrainedTokenizerFast):
    pass
'''


def plant(folder: Path, markers: Path) -> Path:
    """A model folder whose config, model and tokenizer are all classes in its own Python files, each
    of which writes a marker file into `markers` when imported. No tokenizer.json: transformers'
    AutoTokenizer is the only way to read the tokenizer."""
    folder.mkdir(parents=True)
    for kind in PLANTED:
        (folder / f"planted_{kind}.py").write_text(PLANTED_MODULE.format(marker=str(markers / f"ran_{kind}")))
    auto_map = {"AutoConfig": "planted_config.PlantedConfig", "AutoModelForCausalLM": "planted_model.PlantedModel",
                "AutoTokenizer": ["planted_tokenizer.PlantedTokenizer", "planted_tokenizer.PlantedTokenizer"]}
    (folder / "config.json").write_text(json.dumps({"model_type": "planted", "auto_map": auto_map}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PlantedTokenizer", "auto_map": auto_map}))
    return folder


@pytest.fixture
def planted(tmp_path) -> tuple[Path, Path]:
    markers = tmp_path / "markers"
    markers.mkdir()
    return plant(tmp_path / "planted", markers), markers


def script(folder: Path, out: Path, trusted: Path) -> str:
    """`ropelab import`, `ropelab.load` and `ropelab data prepare --tokenizer` on the planted `folder`, each
    printing "RESULT <command> <exit code>" then its error line; last, `ropelab import --trust-remote-code`
    on the planted folder `trusted`."""
    return f"""import sys
import ropelab
from ropelab.cli import main
from ropelab.config import ConfigError

print("RESULT import", main(["import", {str(folder)!r}, "--out", {str(out / "imported")!r}]), flush=True)
try:
    ropelab.load({str(folder)!r})
except ConfigError as exc:
    print(f"RESULT load 2\\nropelab: error: {{exc}}", file=sys.stderr, flush=True)
print("RESULT prepare", main(["data", "prepare", "--source", "stdlib", "--max-documents", "4", "--tokenizer", {str(folder)!r},
                              "--out", {str(out / "tokens")!r}, "--no-progress"]), flush=True)
print("RESULT trusted", main(["import", {str(trusted)!r}, "--out", {str(out / "trusted_import")!r}, "--trust-remote-code"]), flush=True)
"""


def run_script(tmp_path: Path, text: str, stdin: str | None) -> tuple[str, str]:
    """(stdout, stderr) of `python -c text`; `stdin` None: standard input a pipe left open, never written."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        process = subprocess.Popen([sys.executable, "-c", text], stdin=subprocess.PIPE, stdout=out, stderr=err,
                                   env=env, text=True)
        try:
            if stdin is not None:
                process.stdin.write(stdin)
                process.stdin.flush()
            assert process.wait(timeout=300) == 0
        finally:
            process.stdin.close()
    return (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()


@pytest.mark.parametrize("stdin", ["y\n" * 20, None], ids=["yes_on_stdin", "stdin_open"])
def test_planted_code_never_runs_unless_asked(tmp_path, planted, stdin):
    folder, markers = planted
    trusted_markers = tmp_path / "trusted_markers"
    trusted_markers.mkdir()
    trusted = plant(tmp_path / "trusted", trusted_markers)
    out, err = run_script(tmp_path, script(folder, tmp_path, trusted), stdin)

    assert list(markers.iterdir()) == []  # transformers asked nothing, so no "y" answered anything
    assert "[y/N]" not in out + err and "Traceback" not in err
    results = dict(line.split()[1:] for line in (out + err).splitlines() if line.startswith("RESULT"))
    assert results == {"import": "2", "load": "2", "prepare": "2", "trusted": "2"}
    refusals = [line for line in err.splitlines() if line.startswith("ropelab: error:")]
    assert len(refusals) == 4 and all(str(folder) in line and "pass --trust-remote-code" in line for line in refusals[:3])
    assert not (tmp_path / "imported").exists() and not (tmp_path / "tokens" / "manifest.json").exists()
    # with the flag the user says yes: the code runs (then the folder has no weights: a one-line error)
    assert (trusted_markers / "ran_config").is_file()
    assert refusals[3].startswith(f"ropelab: error: {trusted}: could not load a causal LM")


# ------------------------------------------------------------------ ropelab's own export


def partial_rope_model() -> Transformer:
    config = ModelConfig(vocab_size=97, n_layer=2, d_model=64, n_head=4, d_ff=128, max_seq_len=128,
                         rope=RopeConfig(fraction=0.25), tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def test_own_partial_rope_export_imports_back_without_the_flag(tmp_path, capsys):
    ours = partial_rope_model()
    folder = tmp_path / "hf"
    assert save_hf(ours, folder)["route"] == "remote_code"
    marker = tmp_path / "shipped_code_ran"
    for name in ("modeling_ropelab.py", "config_model.py", "model.py"):  # ropelab must not need its shipped copies
        with open(folder / name, "a") as f:
            f.write(f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")

    assert resolve(folder).kind == "export"
    assert main(["import", str(folder), "--out", str(tmp_path / "imported")]) == 0
    assert "RopelabForCausalLM" in capsys.readouterr().out
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(ids)[0]
        for source in (folder, tmp_path / "imported"):
            model, _, config = load(source)
            assert config.model.rope.fraction == 0.25
            assert torch.equal(model(ids)[0], expected)
    assert not marker.exists()
