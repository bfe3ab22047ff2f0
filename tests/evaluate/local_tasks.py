"""Local lm-evaluation-harness tasks for the tests: one YAML template per kind of task, written with
their rows into a folder the harness includes."""

import json
from pathlib import Path

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
