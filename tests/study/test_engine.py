"""`study.engine`: what auto chooses from its measurements, what it records, and compiled steps equal to eager ones."""

import json
import shutil
import tempfile

import pytest

from ropelab.config import ConfigError, build_run_config
from ropelab.study import engine
from ropelab.study.engine import (RECORD, Layout, Probe, StudyPeaks, choose_layout, decide, eager_layout, estimate_s,
                                  group_key, run_probes)
from ropelab.study.grid import StudyConfig, expand, load_study


def fake_measure(step_s):
    """A probe whose step time depends on the layout as `step_s` says; one second of setup, compiled 10 more
    while the inductor cache is cold (the first compiled probe) and 2 more once it is filled."""
    compiled = []

    def measure(tree, layout, folder, study_dir):
        if layout.compile:
            compiled.append(layout)
        return Probe(wall_s=1.0 + (10.0 if len(compiled) == 1 else 2.0) * layout.compile, step_s=step_s(layout))
    return measure


def test_auto_picks_the_fastest_measured_layout_and_records_every_figure(tmp_path):
    speeds = {(1, 2, False): 0.010, (2, 1, False): 0.008, (2, 1, True): 0.005}
    record = choose_layout({}, runs=4, steps=10016, cores=2, folder=tmp_path, study_dir=tmp_path, compiler="g++",
                           allocator=None, measure=fake_measure(lambda layout: speeds[(layout.processes, layout.threads, layout.compile)]))
    assert record["chosen"] == {"processes": 2, "threads": 1, "compile": True, "allocator": None, "stack": 1}
    assert [m["estimate_s"] for m in record["measured"]] == pytest.approx([4 * (1 + 10000 * 0.010), 2 * (1 + 10000 * 0.008),
                                                                           2 * (3 + 10000 * 0.005) + (11 - 3)])
    assert record["measured"][-1]["cold_wall_s"] == 11 and record["measured"][-1]["wall_s"] == 3
    assert record["notes"] == ["no tcmalloc or jemalloc installed: glibc malloc",
                              "stacked members not tried: fewer than two runs start from nothing"]


def test_compile_time_counts_and_a_short_group_stays_eager(tmp_path):
    # compiled steps are faster, but 100 steps do not pay back 10 s of compiling
    record = choose_layout({}, runs=1, steps=100, cores=2, folder=tmp_path, study_dir=tmp_path, compiler="g++", allocator=None,
                           measure=fake_measure(lambda layout: 0.02 if layout.compile else 0.03))
    assert record["chosen"]["compile"] is False and record["chosen"]["processes"] == 1


def test_filling_the_compile_cache_is_paid_once_per_group(tmp_path):
    # 20 runs of 600 steps: 10 s of cold compiling in each would lose; 10 s once and then 2 s each wins
    record = choose_layout({}, runs=20, steps=600, cores=2, folder=tmp_path, study_dir=tmp_path, compiler="g++", allocator=None,
                           measure=fake_measure(lambda layout: 0.02 if layout.compile else 0.03))
    assert record["chosen"]["compile"] is True
    assert record["measured"][-1]["estimate_s"] == pytest.approx(10 * (3 + 584 * 0.02) + 8)


def test_without_a_compiler_or_allocator_auto_says_so_and_tries_neither(tmp_path):
    tried = []
    measure = fake_measure(lambda layout: tried.append(layout) or 0.01)
    record = choose_layout({}, runs=2, steps=1000, cores=2, folder=tmp_path, study_dir=tmp_path, compiler=None, allocator=None,
                           measure=measure)
    assert not any(layout.compile or layout.allocator for layout in tried)
    assert record["notes"][0] == "no C++ compiler found: compiled steps not tried"


def test_an_allocator_is_measured_on_the_best_layout(tmp_path):
    record = choose_layout({}, runs=2, steps=1000, cores=2, folder=tmp_path, study_dir=tmp_path, compiler=None,
                           allocator="/lib/libtcmalloc.so.4",
                           measure=fake_measure(lambda layout: 0.005 if layout.allocator else 0.01))
    assert record["chosen"]["allocator"] == "/lib/libtcmalloc.so.4"
    assert "LD_PRELOAD" in Layout(**record["chosen"]).environment(tmp_path)


def test_stacked_members_are_measured_on_the_best_layout_and_chosen_where_they_pay(tmp_path):
    # 10 runs start from nothing, 6 branch off them; stacked, a step of 5 members costs what 2.5 single steps do
    def step_s(layout):
        return 0.010 * layout.stack / 2 if layout.stack > 1 else {1: 0.012, 2: 0.010}[layout.processes]

    record = choose_layout({}, runs=16, steps=10016, cores=2, folder=tmp_path, study_dir=tmp_path, compiler=None,
                           allocator=None, measure=fake_measure(step_s), alone=10, unstackable=None)
    assert record["chosen"] == {"processes": 2, "threads": 1, "compile": False, "allocator": None, "stack": 5}
    stacked = record["measured"][-1]
    # one round of two stacks of 5, then the 6 other runs in 3 rounds of the two single-thread trainers
    assert stacked["estimate_s"] == pytest.approx((1 + 10000 * 0.025) + 3 * (1 + 10000 * 0.010))
    assert len(record["measured"]) == 3 and record["notes"][-1] == "no tcmalloc or jemalloc installed: glibc malloc"


@pytest.mark.parametrize("candidate", ["compile", "stack"])
def test_a_path_that_rounds_differently_must_save_a_tenth(tmp_path, candidate):
    # compiled or stacked steps 5 % faster than eager ones: not worth results that differ in rounding
    def step_s(layout):
        faster = layout.compile if candidate == "compile" else layout.stack > 1
        return (0.0095 if faster else 0.010) * layout.stack  # a stacked step trains `stack` runs

    record = choose_layout({}, runs=4, steps=10016, cores=2, folder=tmp_path, study_dir=tmp_path,
                           compiler="g++" if candidate == "compile" else None, allocator=None,
                           measure=lambda tree, layout, folder, study_dir: Probe(1.0, step_s(layout)),
                           alone=4, unstackable=None if candidate == "stack" else "compiled steps only here")
    assert record["chosen"]["compile"] is False and record["chosen"]["stack"] == 1
    assert min(m["estimate_s"] for m in record["measured"][2:]) < record["measured"][1]["estimate_s"]


def test_a_bitwise_equal_gain_is_weighed_against_the_layout_chosen_not_a_faster_one_refused(tmp_path):
    # compiled steps 5 % faster are refused (rounding); the allocator's 3 % on eager steps is still taken
    def step_s(layout):
        return 0.0095 if layout.compile else (0.0097 if layout.allocator else 0.010)

    record = choose_layout({}, runs=4, steps=10016, cores=2, folder=tmp_path, study_dir=tmp_path, compiler="g++",
                           allocator="/lib/libtcmalloc.so.4", measure=lambda tree, layout, folder, study_dir: Probe(1.0, step_s(layout)))
    assert record["chosen"]["compile"] is False and record["chosen"]["allocator"] == "/lib/libtcmalloc.so.4"


def test_stacked_members_that_do_not_pay_are_measured_and_left(tmp_path):
    record = choose_layout({}, runs=4, steps=10016, cores=2, folder=tmp_path, study_dir=tmp_path, compiler=None, allocator=None,
                           measure=fake_measure(lambda layout: 0.0101 * layout.stack if layout.stack > 1 else 0.010), alone=4, unstackable=None)
    assert record["chosen"]["stack"] == 1 and record["measured"][-1]["stack"] == 2


@pytest.mark.parametrize("alone, unstackable, note", [
    (4, "model.parallel_block: not supported stacked", "model.parallel_block: not supported stacked"),
    (1, None, "fewer than two runs start from nothing"),
])
def test_stacking_not_tried_says_why(tmp_path, alone, unstackable, note):
    tried = []
    record = choose_layout({}, runs=4, steps=1000, cores=2, folder=tmp_path, study_dir=tmp_path, compiler=None, allocator=None,
                           measure=fake_measure(lambda layout: tried.append(layout) or 0.01), alone=alone,
                           unstackable=unstackable)
    assert all(layout.stack == 1 for layout in tried)
    assert record["notes"][-1] == f"stacked members not tried: {note}"


def test_a_stacked_layout_trains_uncompiled_and_says_so(tmp_path):
    layout = Layout(1, 2, compile=True, stack=8)
    assert layout.describe() == "1 x 2 thread(s), compiled, 8 runs stacked"
    assert engine.COMPILE_ENV not in engine.trainer_layout(layout).environment(tmp_path)
    assert engine.trainer_command([(tmp_path / "a.yaml", tmp_path / "a")]) == [
        "train", "--config", str(tmp_path / "a.yaml"), "--out", str(tmp_path / "a"), "--no-progress"]
    assert engine.trainer_command([(tmp_path / "a.yaml", tmp_path / "a"), (tmp_path / "b.yaml", tmp_path / "b")]) == [
        "train-stacked", "--member", str(tmp_path / "a.yaml"), str(tmp_path / "a"), "--member", str(tmp_path / "b.yaml"),
        str(tmp_path / "b")]


BASE = {"model": {"n_layer": 1, "d_model": 32, "n_head": 2, "n_kv_head": 1, "d_ff": 64},
        "data": {"tokenizer": "bytes", "seq_len": 16}, "train": {"steps": 4, "micro_batch": 2}}


def test_decide_measures_each_group_once_and_reuses_the_record(tmp_path):
    study = StudyConfig(base={**BASE, "train": {"steps": 2000, "micro_batch": 2}},
                        grid={"model.n_layer": [1, 2], "model.rope.fraction": [0.0, 1.0]})
    groups = {}
    for run in expand(study):
        groups.setdefault(group_key(run.config), []).append(run)
    assert len(groups) == 2 and all(len(runs) == 2 for runs in groups.values())
    calls, lines = [], []

    def choose(tree, runs, steps, cores, folder, study_dir, alone, unstackable):
        calls.append(tree["model"]["n_layer"])
        return {"chosen": {"processes": 2, "threads": 1, "compile": True, "allocator": None}, "measured": [], "notes": []}

    layouts = decide("auto", groups, tmp_path, jobs=2, cores=2, choose=choose, echo=lines.append)
    assert sorted(calls) == [1, 2] and set(layouts.values()) == {Layout(2, 1, True)} and len(lines) == 2
    assert decide("auto", groups, tmp_path, jobs=2, cores=2, choose=choose, echo=lines.append) == layouts
    assert len(calls) == 2  # read back from engine.json
    assert set(json.loads((tmp_path / RECORD).read_text())["groups"]) == set(groups)
    assert decide("eager", groups, tmp_path, jobs=2, cores=2) == {key: eager_layout(2, 2) for key in groups}


def test_a_short_group_is_not_measured(tmp_path):
    groups = {"g": expand(StudyConfig(base=BASE, grid={"seed": [0, 1]}))}
    layouts = decide("auto", groups, tmp_path, jobs=2, cores=2, choose=pytest.fail, echo=lambda line: None)
    assert layouts == {"g": eager_layout(2, 2)}
    assert "too few to pay for measuring" in json.loads((tmp_path / RECORD).read_text())["groups"]["g"]["notes"][0]


def test_a_probe_trains_a_run_whose_schedule_is_set_in_steps(tmp_path):
    # a frontier trunk carries its warm-up in steps (21 here), longer than the probe's 16 steps
    tree = build_run_config({**BASE, "train": {"steps": 400, "warmup_steps": 21, "micro_batch": 2}}).to_dict()
    probe = run_probes(tree, Layout(1, 2), tmp_path / "probe", tmp_path)
    assert probe.wall_s > 0 and probe.step_s > 0


def test_a_group_whose_probe_fails_is_trained_eager_with_the_reason(tmp_path):
    study = StudyConfig(base={**BASE, "train": {"steps": 2000, "micro_batch": 2}}, grid={"seed": [0, 1]})
    groups = {"g": expand(study)}

    def choose(*args, **kwargs):
        raise RuntimeError("engine probe (1 x 2 thread(s), eager) failed: out of memory")

    lines = []
    assert decide("auto", groups, tmp_path, jobs=2, cores=2, choose=choose, echo=lines.append) == {"g": eager_layout(2, 2)}
    assert lines == ["engine g (2 runs): 2 x 1 thread(s), eager; eager: engine probe (1 x 2 thread(s), eager) failed: "
                     "out of memory"]


def test_the_cpu_peak_is_measured_once_per_dtype_and_threads_for_the_whole_study(monkeypatch):
    import torch

    from ropelab.train.throughput import PEAKS_ENV

    measured = []
    monkeypatch.setattr(engine, "measure_cpu_peak", lambda dtype, threads: measured.append((dtype, threads)) or 1e11 * threads)
    peaks = StudyPeaks()
    fp32 = {"train": {"precision": "fp32", "device": "cpu"}}
    assert peaks.environment(fp32, 1) == {PEAKS_ENV: "float32/1=100000000000.0"}
    assert peaks.environment(fp32, 1) == peaks.environment({"train": {"device": "cpu"}}, 1)
    assert peaks.environment(fp32, 2) == {PEAKS_ENV: "float32/1=100000000000.0,float32/2=200000000000.0"}
    assert measured == [(torch.float32, 1), (torch.float32, 2)]
    if not torch.cuda.is_available():  # a run on a missing GPU says so itself
        assert peaks.environment({"train": {"device": "cuda"}}, 1) == {}


def test_estimate_counts_rounds_of_runs():
    assert estimate_s(Probe(2.0, 0.1), Layout(2, 1), runs=3, steps=116) == 2 * (2.0 + 100 * 0.1)
    assert estimate_s(Probe(2.0, 0.1), Layout(2, 1, stack=4), runs=9, steps=116) == 2 * (2.0 + 100 * 0.1)


def test_an_unknown_engine_is_one_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\nengine: fast\ngrid: {seed: [0]}\n")
    with pytest.raises(ConfigError, match=r"engine='fast': must be one of 'auto', 'eager'"):
        load_study(path)
    path.write_text("name: x\ngrid: {seed: [0]}\n")
    assert load_study(path).engine == "auto"


# Compiled against eager steps, fp32, on the claims' shape (d_model 64, one head, d_ff 192, bytes): the
# trainer's own losses, one run per position encoding. Needs inductor's C++ compiler.
CLAIMS_SHAPE = ["model.n_layer=1", "model.d_model=64", "model.n_head=1", "model.n_kv_head=1", "model.d_ff=192",
                "data.corpus=stdlib", "data.tokenizer=bytes", "data.seq_len=64", "train.micro_batch=4", "train.precision=fp32",
                "train.lr=2e-3", "train.steps=8", "train.eval_every=8", "train.eval_batches=2", "train.checkpoint_every=8",
                "train.progress=false", "train.tensorboard=false"]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile's inductor CPU backend needs a C++ compiler (g++ or c++)")
@pytest.mark.parametrize("position", ["model.rope.fraction=0.0", "model.rope.rotary_dims=2", "model.rope.fraction=0.25"])
def test_compiled_steps_equal_eager_ones(position, monkeypatch, tmp_path):
    from ropelab.train.loop import COMPILE_ENV, train
    from ropelab.train.metrics import read_metrics

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    curves = {}
    for compiled in (False, True):
        monkeypatch.setenv(COMPILE_ENV, "1" if compiled else "0")
        with tempfile.TemporaryDirectory() as folder:
            result = train(build_run_config({"preset": "tiny-llama"}, overrides=[*CLAIMS_SHAPE, position]), f"{folder}/run")
            curves[compiled] = ([r["loss"] for r in read_metrics(f"{folder}/run") if "loss" in r], result.final_val_loss)
    (eager, eager_val), (compiled, compiled_val) = curves[False], curves[True]
    assert len(eager) == 8 and compiled == pytest.approx(eager, rel=1e-5)
    assert abs(compiled_val - eager_val) < 0.002


def test_engine_benchmark_profiles_a_step_and_ends_with_its_figures():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "engine.py"
    done = subprocess.run([sys.executable, str(script), "--parts", "profile", "--sizes", "1"], capture_output=True, text=True,
                          timeout=300, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["sgemm_gflops"] > 0 and figures["machine"]
    assert set(figures["profile"]) == {"matmul", "attention", "elementwise and other"}
    assert sum(figures["profile"].values()) == pytest.approx(1.0) and figures["profile"]["matmul"] > 0


def test_engine_benchmark_times_plain_and_warm_trainers_from_start_to_exit():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "engine.py"
    done = subprocess.run([sys.executable, str(script), "--parts", "startup", "--shapes", "1x32", "--startup-runs", "1",
                           "--tokens-per-param", "0.5"], capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])["startup"]
    assert [(r["engine"], r["steps"]) for r in figures["rows"]] == [("eager", 4), ("auto", 4)]
    assert all(r["wall_s_per_run"] > 0 and r["tokens_per_s_per_run"] < r["training_tokens_per_s_per_run"] for r in figures["rows"])
