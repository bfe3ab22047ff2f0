"""lm-evaluation-harness on ropelab runs: local tasks end to end, the same numbers (to 1e-4) through
`evaluate_lm`, the harness's CLI with `--model ropelab`, and `--model hf` on the exported folder with
no model_args but dtype (item by item, for a BPE and a byte-level run); the paper suite offline fails
fast with one line naming a dataset."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

lm_eval = pytest.importorskip("lm_eval")

from ropelab.cli import build_parser  # noqa: E402
from ropelab.evaluate.lm_eval import evaluate_lm  # noqa: E402
from ropelab.evaluate.lm_eval_report import results_markdown, select_metrics  # noqa: E402
from ropelab.evaluate.lm_eval_tasks import PAPER_TASKS, resolve_tasks  # noqa: E402
from tests.evaluate.local_tasks import write_tasks  # noqa: E402

TOL = 1e-4
TASKS = ["local_mc", "local_ppl", "lambada_local", "local_gen"]
MC = [
    {"question": "What does len([1, 2, 3]) return?", "choices": ["3", "an error", "[1, 2, 3]"], "label": 0},
    {"question": "Which keyword defines a function?", "choices": ["class", "def", "import"], "label": 1},
    {"question": "What is 2 + 2?", "choices": ["five", "22", "4"], "label": 2},
    {"question": "Which value is falsy?", "choices": ["0", "1", "'a'"], "label": 0},
    {"question": "What does print return?", "choices": ["the text", "None"], "label": 1},
]
PPL = [
    {"text": "def add(a, b):\n    return a + b\n"},
    {"text": "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
             "        print(name, os.path.getsize(os.path.join(argv[1], name)))\n    return 0\n"},  # > 32 tokens: rolling windows
    {"text": "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"},
]
LAMBADA = [
    {"context": "for i in range(10):\n    print(", "word": "i"},
    {"context": "import os\nprint(os.path.join('a', 'b'))\nimport", "word": " sys"},
    {"context": "def f(self):\n    return", "word": " self"},
    {"context": "for i in range(10)", "word": ":\n    print(i)\n"},  # longer than max_length (32) as bytes
    {"context": "for i in range(1", "word": "0):\n    print(i)\n"},  # the same text, split elsewhere: see GROUPED
    {"context": "def f(self):\n    return ", "word": "self"},  # trailing whitespace: moved to the continuation
    {"context": "x = 1\n\n", "word": "y = 2"},
    {"context": "", "word": "import os"},  # the prefix token stands for the context
]
GEN = [{"question": "def add(a, b):\n", "answer": "    return a + b"}, {"question": "import", "answer": " os"}]
# lm-eval 0.4.13's `--model hf` scores the requests whose context + continuation minus its last token
# coincide with one forward pass, and reads the shorter continuation's log-probs at the first positions
# of the longer one's: LAMBADA's row 3 gets row 4's positions (docs/export-and-lm-eval.md#grouped-requests).
# `--model ropelab` scores every request on its own; the hf route is compared on the other items.
GROUPED = {("lambada_local", 3, 0)}



@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("tasks"), {
        "local_mc": ("mc", MC), "local_ppl": ("ppl", PPL), "lambada_local": ("cloze", LAMBADA), "local_gen": ("gen", GEN)})


@pytest.fixture(scope="module")
def hf_env(tmp_path_factory):
    """A private datasets cache for the module; child processes get it through the environment."""
    import datasets

    cache = tmp_path_factory.mktemp("hf_home")
    env = {"HF_HOME": str(cache), "HF_DATASETS_CACHE": str(cache / "datasets")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache / "datasets"))
        yield env


def _numbers(per_task: dict) -> dict:
    return {
        (task, key.split(",")[0]): float(value)
        for task, metrics in per_task.items() for key, value in metrics.items()
        if "," in key and "_stderr" not in key and isinstance(value, (int, float))
    }


def _assert_same(ours: dict, theirs: dict, what: str) -> None:
    assert set(ours) == set(theirs), what
    for key in ours:
        assert abs(ours[key] - theirs[key]) <= TOL * max(1.0, abs(ours[key])), f"{what}: {key} {ours[key]} vs {theirs[key]}"


def _item_answers(result: dict) -> dict:
    """{(task, doc_id, request): the model's answer as a list}: log-likelihood and greedy flag, a
    rolling log-likelihood, or a generated text."""
    return {
        (task, sample["doc_id"], i): list(answer) if isinstance(answer, tuple) else [answer]
        for task, samples in result["samples"].items() for sample in samples
        for i, (answer,) in enumerate(sample["resps"])
    }


def _assert_same_items(ours: dict, theirs: dict, what: str, skip=frozenset()) -> None:
    ours, theirs = _item_answers(ours), _item_answers(theirs)
    assert set(ours) == set(theirs), what
    for key, answer in ours.items():
        for a, b in zip(answer, theirs[key], strict=True):
            if key in skip and isinstance(a, float):
                continue
            same = abs(a - b) <= TOL * max(1.0, abs(a)) if isinstance(a, float) else a == b
            assert same, f"{what}: {key} {answer} vs {theirs[key]}"


def _export_and_compare(run, tasks_dir, tmp_path) -> dict:
    """`--model hf` on `run`'s export (dtype its only model_arg) against `--model ropelab` on `run`, every
    item of TASKS; returns the hf result."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from ropelab.export.hf import export_hf

    export_hf(run, tmp_path / "hf")
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    common = {"tasks": TASKS, "task_manager": manager, "bootstrap_iters": 0, "log_samples": True}
    ours = simple_evaluate(model="ropelab", model_args=f"pretrained={run}", **common)
    _assert_direct_loglikelihoods(ours, run)
    hf = simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32", batch_size=4,
                         device="cpu", **common)
    _assert_same_items(ours, hf, "--model hf", skip=GROUPED)
    _assert_same(_outside_grouped(_numbers(ours["results"])), _outside_grouped(_numbers(hf["results"])), "--model hf")
    return hf


def _outside_grouped(numbers: dict) -> dict:
    """The figures of the tasks without a GROUPED item (the hf route's differ on those)."""
    return {key: value for key, value in numbers.items() if key[0] not in {task for task, _, _ in GROUPED}}


def _assert_direct_loglikelihoods(result: dict, run) -> None:
    """Each log-likelihood of the cloze task (contexts neither empty nor ending in whitespace, which the
    harness rewrites) equals log p(continuation | context) from one forward pass of the run's model on
    that request alone, in a window of max_length tokens as the harness cuts it."""
    import torch

    from ropelab import load

    model, tokenizer, config = load(run)
    window = config.data.seq_len + 1
    checked = set()
    for sample in result["samples"]["lambada_local"]:
        ((context, continuation),), (((score, _),),) = sample["arguments"], sample["resps"]
        if not context or context != context.rstrip():
            continue
        context_ids, whole = tokenizer.encode_batch([context, context + continuation])
        targets = torch.tensor(whole[len(context_ids):])
        with torch.no_grad():
            logits, _ = model(torch.tensor([whole[-window:][:-1]]))
        logprobs = torch.log_softmax(logits[0, -len(targets):].float(), dim=-1)
        direct = logprobs.gather(-1, targets[:, None]).sum().item()
        assert abs(score - direct) <= TOL * max(1.0, abs(direct)), f"{sample['doc_id']}: {score} vs {direct}"
        checked.add(sample["doc_id"])
    assert {3, 4} <= checked


def test_local_tasks_same_numbers_three_routes(run, tasks_dir, hf_env, tmp_path):
    # lm-eval's own CLI with --model ropelab (the registering wrapper), in a fresh process that runs
    # while the in-process routes below do (it spends ~10 s indexing the harness's built-in tasks)
    cli_out, cli_log = tmp_path / "cli", tmp_path / "cli.log"
    with open(cli_log, "w") as log:
        cli = subprocess.Popen(
            [sys.executable, "-m", "ropelab.evaluate.lm_eval", "run", "--model", "ropelab",
             "--model_args", f"pretrained={run}", "--tasks", ",".join(TASKS), "--include_path", str(tasks_dir),
             "--output_path", str(cli_out)],
            stdout=log, stderr=subprocess.STDOUT, env=os.environ | hf_env,
        )
    try:
        hf_checked = _in_process_routes(run, tasks_dir, tmp_path)
        assert cli.wait(timeout=120) == 0, cli_log.read_text()[-2000:]
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    (cli_json,) = cli_out.rglob("results_*.json")
    ours = _numbers(json.loads((tmp_path / "eval" / "results.json").read_text())["runs"][0]["lm_eval"])
    _assert_same(ours, _numbers(json.loads(cli_json.read_text())["results"]), "--model ropelab (lm-eval CLI)")
    if not hf_checked:
        pytest.skip("--model hf not checked: it needs accelerate (pip install 'lm-eval[hf]')")


def _in_process_routes(run, tasks_dir, tmp_path):
    # ropelab's own entry point: reports for one run
    out = tmp_path / "eval"
    results = evaluate_lm([run], TASKS, out, include_path=tasks_dir, bootstrap_iters=0)
    assert sorted(p.name for p in out.iterdir()) == ["lambada_ppl_vs_fraction.png", "results.json", "results.md"]
    entry = results["runs"][0]
    assert entry["label"] == "run" and entry["effective_rope_fraction"] == 1.0 and entry["max_length"] == 32
    assert set(entry["metrics"]) == set(TASKS)
    assert set(entry["metrics"]["local_mc"]) == {"acc_norm"} and set(entry["metrics"]["lambada_local"]) == {"acc", "perplexity"}
    assert entry["metrics"]["lambada_local"]["perplexity"][0] > 1
    assert json.loads((out / "results.json").read_text())["runs"][0]["metrics"] == json.loads(json.dumps(entry["metrics"]))
    table = (out / "results.md").read_text().splitlines()
    assert table[0] == "| task | metric | run |" and any(row.startswith("| lambada_local | perplexity") for row in table)
    ours = _numbers(entry["lm_eval"])

    # --model hf on the exported folder, item by item, the generations token for token
    if importlib.util.find_spec("accelerate") is None:
        return False
    _assert_same(_outside_grouped(ours), _outside_grouped(_numbers(_export_and_compare(run, tasks_dir, tmp_path)["results"])),
                 "--model hf")
    return True


def test_byte_level_export_scores_every_item_as_its_run(tiny_session_overrides, tasks_dir, hf_env, tmp_path):
    pytest.importorskip("accelerate", reason="--model hf needs accelerate (pip install 'lm-eval[hf]')")
    from ropelab.config import build_run_config
    from ropelab.train.loop import train

    run = tmp_path / "bytes-run"
    train(build_run_config(overrides=[*tiny_session_overrides, "train.steps=4"]), run)
    _export_and_compare(run, tasks_dir, tmp_path)


def test_paper_suite_offline_fails_fast_with_one_line(run, hf_env, tmp_path):
    # An unreachable endpoint: the reachability probe must switch to offline mode instead of retrying.
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("HF_", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"))}
    env |= hf_env | {"HF_ENDPOINT": "http://127.0.0.1:9"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ropelab", "eval", "lm", str(run), "--tasks", "paper", "--out", str(tmp_path / "paper")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ropelab: error: task arc_easy: dataset allenai/ai2_arc"), lines[0]
    assert elapsed < 30, elapsed
    assert not (tmp_path / "paper").exists()


def test_paper_suite_names_and_metrics():
    assert resolve_tasks("paper") == PAPER_TASKS
    assert "wsc273" in PAPER_TASKS and "lambada_openai" in PAPER_TASKS and len(PAPER_TASKS) == 9
    assert resolve_tasks("arc_easy, piqa,arc_easy") == ["arc_easy", "piqa"]
    harness = {"acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.6, "acc_norm_stderr,none": 0.1, "alias": "x"}
    assert select_metrics("arc_easy", harness) == ["acc_norm"]
    assert select_metrics("winogrande", harness) == ["acc"]
    assert select_metrics("lambada_openai", {"perplexity,none": 9.0, "acc,none": 0.4}) == ["acc", "perplexity"]
    assert select_metrics("custom", {"exact_match,strict": 0.1}) == ["exact_match"]
    fake = {"lm_eval_version": "x", "limit": None, "tasks": ["piqa"], "runs": [
        {"label": "a", "checkpoint": "a/c", "effective_rope_fraction": 0.25, "metrics": {"piqa": {"acc_norm": [0.61, 0.01]}}},
        {"label": "b", "checkpoint": "b/c", "effective_rope_fraction": 1.0, "metrics": {"piqa": {"acc_norm": [0.63, None]}}},
    ]}
    assert results_markdown(fake).splitlines()[:3] == [
        "| task | metric | a | b |", "|---|---|---|---|", "| piqa | acc_norm ↑ | 0.6100 ± 0.0100 | 0.6300 |",
    ]


def test_cli_parses_eval_lm():
    args = build_parser().parse_args(["eval", "lm", "r1", "r2", "--tasks", "paper", "--out", "o", "--limit", "5"])
    assert args.command == "eval" and args.eval_command == "lm" and args.runs == ["r1", "r2"]
    assert args.out_dir == "o" and args.limit == 5 and args.include_path is None
