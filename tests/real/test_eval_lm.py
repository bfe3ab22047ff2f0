"""lm-evaluation-harness on the real model: local tasks give the same numbers through `--model ropelab`
on the imported SmolLM2-135M and through the harness's own `--model hf` on its export (`ropelab export`),
each with its own defaults (the model's 8,192-token context, <|endoftext|> as the prefix token), and again
with a 32-token context, where the perplexity task is scored in rolling windows. A few short documents
keep it to a few seconds a route."""

from __future__ import annotations

import math

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate", reason="--model hf needs accelerate (pip install 'lm-eval[hf]')")

import ropelab.evaluate.lm_eval  # noqa: E402, F401 - registers "ropelab" with the harness
from tests.evaluate.local_tasks import write_tasks  # noqa: E402

TOL = 1e-4  # relative; ropelab forms the RoPE angles in float64, transformers in float32
PPL = [
    {"text": "def add(a, b):\n    return a + b\n"},
    {"text": "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
             "        print(name, os.path.getsize(os.path.join(argv[1], name)))\n    return 0\n"},
    {"text": "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
             "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."},
]
CLOZE = [  # a LAMBADA-like continuation log-likelihood: the context/continuation split with a real BPE
    {"context": "The capital of France is", "word": " Paris"},
    {"context": "for i in range(10):\n    print(", "word": "i)"},
    {"context": "Water freezes at zero degrees", "word": " Celsius"},
]
TASKS = ["real_ppl", "real_cloze"]


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    root = write_tasks(tmp_path_factory.mktemp("real-tasks"), {"real_ppl": ("ppl", PPL), "real_cloze": ("cloze", CLOZE)})
    return TaskManager(include_path=str(root), include_defaults=False)


def _evaluate(model: str, model_args: str, manager) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, model_args=model_args, tasks=TASKS, task_manager=manager, batch_size=4,
                           device="cpu", bootstrap_iters=0, log_samples=True)


def _numbers(result: dict) -> dict:
    """{(task, metric): value} and {(task, doc, "loglikelihood"): value} of one harness result."""
    numbers = {
        (task, key.split(",")[0]): float(value)
        for task, metrics in result["results"].items() for key, value in metrics.items()
        if "," in key and "_stderr" not in key and isinstance(value, (int, float))
    }
    for task, samples in result["samples"].items():
        for sample in samples:
            response = sample["filtered_resps"][0]
            value = response[0] if isinstance(response, (list, tuple)) else response  # (ll, greedy) or ll
            numbers[(task, sample["doc_id"], "loglikelihood")] = float(value)
    return numbers


def _assert_same(ours: dict, theirs: dict, what: str) -> None:
    assert set(ours) == set(theirs) and len(ours) == 5 + len(PPL) + len(CLOZE), what
    for key, value in ours.items():
        assert math.isfinite(value) and abs(value - theirs[key]) <= TOL * max(1.0, abs(value)), \
            f"{what}: {key} ropelab {value} vs hf {theirs[key]}"


@pytest.mark.parametrize("max_length", [None, 32], ids=["defaults", "rolling-32"])
def test_same_perplexity_through_model_ropelab_and_model_hf(smollm2_folder, smollm2_export, task_manager, max_length):
    extra = "" if max_length is None else f",max_length={max_length}"
    ours = _evaluate("ropelab", f"pretrained={smollm2_folder}{extra}", task_manager)
    assert ours["config"]["max_length"] == (max_length or 8192)  # the model's context, not data.seq_len
    theirs = _evaluate("hf", f"pretrained={smollm2_export},dtype=float32{extra}", task_manager)
    ours_n, theirs_n = _numbers(ours), _numbers(theirs)
    _assert_same(ours_n, theirs_n, f"max_length={max_length}")
    # a real model: Python and English at well under 2 bits per byte (a random model of this vocabulary: ~7)
    assert 0.3 < ours_n[("real_ppl", "bits_per_byte")] < 1.5
    assert ours_n[("real_cloze", "acc")] >= 2 / 3  # " Paris", "i)" and " Celsius" are greedy continuations
