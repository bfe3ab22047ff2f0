"""The report of a conversion study: a row per run with its plan, latent rank and cache, losses and KL,
the study's long-context and lm-eval scores beside them, and MHA2MLA's published figures by plan and rank."""

from __future__ import annotations

import json

import pytest

from ropelab.config import build_run_config
from ropelab.study.conversion import conversion_rows, conversion_section
from ropelab.study.report import write_report

MODEL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.head_dim=16"]
# a 2-norm plan as a study's run records it: the pairs each KV head keeps, per layer
PAIRS = ["model.rope_layers={0: {pairs: [[6, 7], [5, 7]]}, 1: {pairs: [[6, 7], [4, 7]]}}"]
RUNS = {  # name: (overrides, steps, loss right after conversion, final validation loss)
    "full": ([], 0, 2.0, 2.0),
    "pairs2": (PAIRS, 0, 3.0, 3.0),
    "mla-d8": ([*PAIRS, "model.mla.rank=8"], 0, 6.0, 6.0),
    "kd-mla-d8": ([*PAIRS, "model.mla.rank=8", "distill.teacher=src"], 10, 6.0, 4.5),
    "ce-mla-d8": ([*PAIRS, "model.mla.rank=8", "distill.teacher=src", "distill.alpha=0"], 10, 6.0, 4.0),
}


def _write_run(folder, name, overrides, steps, converted, final):
    run = folder / "runs" / name
    run.mkdir(parents=True)
    config = build_run_config({}, None, [*MODEL, *overrides, f"train.steps={steps}", "train.init_from=src"])
    (run / "config.yaml").write_text(config.to_yaml())
    rows = [{"step": 0, "tokens": 0, "val_loss": converted}]
    if steps:
        rows += [{"step": steps, "tokens": 100 * steps, "loss": final, "kd": final / 2, "val_loss": final}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversion = {} if name == "full" else {"select": "2-norm", "keep_pairs": 2, "loss_source": 2.0,
                                            "loss_converted": converted, "kl_to_source": converted - 2.0}
    (run / "result.json").write_text(json.dumps({
        "run_dir": str(run), "steps": steps, "final_train_loss": final, "final_val_loss": final, "tokens": 100 * steps,
        "wall_time_s": 1.0, "tokens_per_s": 1.0, "skipped_steps": 0, "phases": [], "branch_from": None,
        "init_from": {"source": "src", "kind": "run", "conversion": conversion}}))


@pytest.fixture()
def study(tmp_path):
    """A conversion study's runs, and its long-context and lm-eval results for all but one of them."""
    folder = tmp_path / "study"
    for name, spec in RUNS.items():
        _write_run(folder, name, *spec)
    (folder / "longctx").mkdir()
    (folder / "longctx" / "longctx.json").write_text(json.dumps({"runs": [
        {"label": name, "tasks": {"passkey": {"acc_at_1": 1.0 if name == "full" else 0.25, "mrr": 0.5}}}
        for name in RUNS if name != "ce-mla-d8"]}))
    (folder / "lm_eval").mkdir()
    (folder / "lm_eval" / "results.json").write_text(json.dumps({"runs": [
        {"label": name, "metrics": {"lambada_wiki": {"acc": [0.48, 0.03], "perplexity": [9.03, 1.1]}}} for name in RUNS]}))
    return folder


def test_each_run_has_its_cache_and_the_scores_the_study_measured(study):
    rows = {r["run"]: r for r in conversion_rows(study)}
    # 2 KV heads of 16 channels: 2 x 2 x 16 = 64 values whole; 2 x (8 + 4) = 24 with the latent
    assert (rows["full"]["cache_values"], rows["pairs2"]["cache_values"], rows["kd-mla-d8"]["cache_values"]) == (64, 64, 24)
    assert rows["kd-mla-d8"]["cache_saved"] == pytest.approx(1 - 24 / 64) and rows["pairs2"]["cache_saved"] == 0
    assert (rows["kd-mla-d8"]["rank"], rows["pairs2"]["rank"]) == (8, None)
    assert rows["kd-mla-d8"]["scores"] == {"passkey acc@1 (MRR)": "0.25 (0.50)", "lambada_wiki acc": "0.480",
                                           "lambada_wiki ppl": "9.03"}
    assert "passkey acc@1 (MRR)" not in rows["ce-mla-d8"]["scores"]  # not evaluated: left blank, not invented


def test_the_section_puts_mha2mla_figures_by_selection_and_by_rank_beside_ours(study):
    markdown = conversion_section(study).markdown
    assert "| kd-mla-d8 | 2-norm r=2, latent d=8 | 24 values, 48 B (-62.5%) | KD | 1,000 | 6.000 |" in markdown
    assert "| full | full r=8 | 64 values, 128 B | none |" in markdown
    assert "0.25 (0.50) | 0.480 | 9.03 |" in markdown and "| — | 0.480 | 9.03 |" in markdown  # ce: no long-context row
    # partial RoPE alone: the pairs-only run, never a latent run's loss, beside Table 5's 2-norm average
    assert "| 2-norm | 43.77 | 3.000 | — | — |" in markdown
    # the latent: Table 1 at d_kv 8 beside our rank-8 plan
    assert "| 8 | -87.50% | 40.97 | 2-norm r=2 | -62.50% | 6.000 | 4.500 | 4.000 |" in markdown
    assert "| 32 | -68.75% | 43.06 | — | — | — | — | — |" in markdown


def test_unreadable_evaluations_leave_the_table_without_their_columns(study):
    (study / "longctx" / "longctx.json").write_text("{not json")
    (study / "lm_eval" / "results.json").write_text('{"runs": 5}')
    assert all(row["scores"] == {} for row in conversion_rows(study))
    assert "acc@1" not in conversion_section(study).markdown


def test_the_written_report_names_groups_without_the_plans_layers(study):
    (study / "study.yaml").write_text(json.dumps({"name": "s", "runs": {}}))
    write_report(study)
    report = (study / "report.md").read_text()
    assert "RoPE conversion and recovery" in report and "rope_layers.0" not in report


def test_the_final_kl_is_the_held_out_one_where_measured_and_the_conversions_for_a_run_never_trained(study):
    (study / "conversion").mkdir()
    (study / "conversion" / "held_out.json").write_text(json.dumps({"kd-mla-d8": {"kl_to_source": 1.25}}))
    rows = {r["run"]: r for r in conversion_rows(study)}
    assert (rows["kd-mla-d8"]["final_kl"], rows["mla-d8"]["final_kl"], rows["ce-mla-d8"]["final_kl"]) == (1.25, 4.0, None)
    markdown = conversion_section(study).markdown
    assert "| 4.500 | 1.250 | 2.250 |" in markdown and "| 4.000 | — | 2.000 |" in markdown
