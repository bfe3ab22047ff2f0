"""Local lm-evaluation-harness tasks for the tests: one YAML template per kind of task, written with
their rows into a folder the harness includes; and the tasks shipped in configs/eval, loaded as
ropelab loads them."""

import json
from pathlib import Path

import pytest

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "eval"

TEMPLATES = {
    "mc": """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
""",
    "ppl": """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - {{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}}
""",
    "cloze": """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{word}}}}"
target_delimiter: ""
metric_list:
  - {{metric: perplexity, aggregation: perplexity, higher_is_better: false}}
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
""",
    "gen": """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\n"], max_gen_toks: 8, do_sample: false}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
""",
}


def write_tasks(root: Path, tasks: dict[str, tuple[str, list[dict]]]) -> Path:
    """{task name: (kind, rows)} -> root/<name>.jsonl and root/<name>.yaml; returns root."""
    for name, (kind, rows) in tasks.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(TEMPLATES[kind].format(name=name, data=json.dumps(str(data))))
    return root


def load_shipped_task(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(the harness's task, its docs, the rows of its jsonl file) of a task of configs/eval, loaded
    through ropelab's lm-eval task loading from the checkout (the data_files path is relative to it)."""
    pytest.importorskip("lm_eval")
    from ropelab.evaluate.lm_eval_tasks import load_tasks

    monkeypatch.chdir(SHIPPED.parents[1])
    _, loaded = load_tasks([name], include_path=str(SHIPPED))
    task = loaded[name]["tasks"][name]
    rows = [json.loads(line) for line in (SHIPPED / f"{name}.jsonl").read_text().splitlines()]
    return task, list(task.test_docs()), rows
