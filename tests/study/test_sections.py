"""Study runs that refer to each other, and the optional report sections (phases, long context, extrapolation,
memory)."""

import json
import shutil

import pytest
import yaml

from ropelab.config import ConfigError
from ropelab.study.grid import StudyConfig, expand, references, resolve_references
from ropelab.study.extrapolation import evaluate_study_extrapolation
from ropelab.study.grid import load_study
from ropelab.study.report import write_report
from ropelab.study.sections import longctx_section, memory_section, phase_section

PHASED = {"preset": "tiny-llama", "train": {"phases": [{"name": "short", "steps": 3}, {"name": "long", "steps": 2}]}}


def test_run_references_resolve_to_run_directories():
    study = StudyConfig(base=PHASED, variants=[{"name": "teacher", "train.phases": [], "train.steps": 5},
                                               {"name": "student", "distill": {"teacher": "@teacher"}},
                                               {"name": "student-long", "distill": {"teacher": "@teacher"},
                                                "train.phases[1].overrides.model.rope.theta": 500000}])
    runs = {r.id: r for r in expand(study)}
    assert references(runs["student"].config) == [("distill.teacher", "teacher")] and references(runs["teacher"].config) == []
    resolved = resolve_references(runs["student"].config, {"teacher": "/s/runs/teacher"})
    assert resolved["distill"]["teacher"] == "/s/runs/teacher"
    assert runs["student-long"].config.train.phases[1].overrides == {"model.rope.theta": 500000}


def test_reference_to_a_missing_run_is_refused():
    study = StudyConfig(base=PHASED, variants=[{"name": "student", "distill": {"teacher": "@nobody"}}])
    with pytest.raises(ConfigError, match="'@nobody' must name another run"):
        expand(study)


def test_bad_phase_override_in_a_study_is_refused_before_any_run():
    study = StudyConfig(base=PHASED, variants=[{"name": "a", "train.phases[1].overrides.data.nope": 1}])
    with pytest.raises(ConfigError, match=r"run a: train.phases\[1\] \(long\): data.nope: unknown key"):
        expand(study)


def _fake_run(study_dir, run_id, phases):
    run = study_dir / "runs" / run_id
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    rows = [{"step": s, "tokens": 10 * s, "loss": 3.0 - 0.1 * s} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "result.json").write_text(json.dumps({"steps": 5, "final_train_loss": 2.5, "final_val_loss": 2.6, "tokens": 50,
                                                  "wall_time_s": 1.0, "tokens_per_s": 50.0, "phases": phases}))


def test_phase_table_and_long_context_section_reach_the_report(tmp_path):
    _fake_run(tmp_path, "kd", [{"name": "short", "end_step": 3, "val_loss": 2.75}, {"name": "long", "end_step": 5, "val_loss": 2.5}])
    _fake_run(tmp_path, "teacher", [])
    section = phase_section(tmp_path)
    assert "| kd | 2.7500 | 2.5000 |" in section.markdown and "teacher" not in section.markdown
    assert longctx_section(tmp_path) is None
    (tmp_path / "longctx").mkdir()
    (tmp_path / "longctx" / "longctx.md").write_text("# Long-context evaluation\n\n| task | metric |\n")
    (tmp_path / "longctx" / "longctx_heatmap.png").write_bytes(b"\x89PNG fake")
    paths = write_report(tmp_path)
    text = paths["report.md"].read_text()
    assert "## Validation loss after each phase" in text and "## Long-context evaluation" in text
    assert "![longctx/longctx_heatmap.png](longctx/longctx_heatmap.png)" in text
    assert "Validation loss after each phase" in paths["report.html"].read_text()


def test_extrapolation_section_holds_the_figure_and_the_table(run, tmp_path):
    (tmp_path / "runs").mkdir()
    shutil.copytree(run, tmp_path / "runs" / "rope100")
    options = {"lengths": [64], "methods": ["none", "linear"], "windows": 1, "passkey": False}
    assert evaluate_study_extrapolation(tmp_path, options, ["rope100"], progress=False) is not None
    assert evaluate_study_extrapolation(tmp_path, options, ["rope100"], progress=False) is None  # kept, not redone
    text = write_report(tmp_path)["report.md"].read_text()
    section = text.split("## Extrapolation", 1)[1]
    assert "![extrapolation/loss_by_position.png](extrapolation/loss_by_position.png)" in section
    assert "| method | 64 (2 T0) |" in section and "| linear |" in section
    assert (tmp_path / "extrapolation" / "loss_by_position.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "extrapolation" / "extrapolation.json").read_text())["runs"][0]["cells"][1]["method"] == "linear"


def test_a_bad_extrapolation_option_in_a_study_is_refused_at_load(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\nvariants: [{name: a}]\nextrapolation: {lengths: [512], methods: [none, pi]}\n")
    with pytest.raises(ConfigError, match=r"s.yaml: extrapolation: methods=none,pi: choose one or more of"):
        load_study(path)


def test_memory_section_gives_each_layout_its_tables_and_kv_cache_at_128k(tmp_path):
    sliding = {"attention": "sliding", "window": 64}
    models = {
        "allrope-seed0": {}, "allrope-seed1": {},
        "lllg-seed0": {"layer_pattern": "LLLG", "layer_kinds": {"L": sliding, "G": {"rope": "none"}}},
        "lllp-fraction0.25-seed0": {"rope": {"fraction": 0.25}, "layer_pattern": "LLLP",
                                    "layer_kinds": {"L": sliding, "P": {"rope": {"fraction": 0.25, "style": "truncate"}}}},
    }
    for run, model in models.items():
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "config.yaml").write_text(yaml.safe_dump({"model": model}))
    (tmp_path / "runs" / "not-started").mkdir()
    section = memory_section(tmp_path)
    # tiny-llama: 4 layers of one 64-wide KV head; 131,072 positions: a full-RoPE fp32 table (32 pairs) and a
    # full layer's bf16 keys and values are 32 MiB each, a 64-token window's 16 KiB
    assert section.title == "RoPE tables and KV cache at 131,072 tokens"
    assert "| allrope | — | 32.00 MiB | 128.00 MiB |" in section.markdown
    assert "| lllg | LLLG | 32.00 MiB | 32.05 MiB |" in section.markdown
    # a quarter of the head twice: sliced and truncated frequencies are two tables
    assert "| lllp-fraction0.25 | LLLP | 16.00 MiB | 32.05 MiB |" in section.markdown
    assert "not-started" not in section.markdown and "<td>LLLG</td>" in section.html
    (tmp_path / "empty" / "runs").mkdir(parents=True)
    assert memory_section(tmp_path / "empty") is None
