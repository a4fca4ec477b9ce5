"""Two tiny lm-evaluation-harness task files of one's own, with their data beside them (no network): a
multiple-choice task (Python code or byte noise: a model that learned Python text prefers the code) and a
loglikelihood task (a Python line and its next word)."""

from __future__ import annotations

import json
from pathlib import Path

MC_TASK, LL_TASK = "py_mc", "py_ll"
MC_DOCS = [
    {"question": "import", "choices": [" os", " ~^`"], "answer": 0},
    {"question": "def f(self", "choices": ["):", "\x7f~\x60"], "answer": 0},
    {"question": "    return", "choices": [" None", "|^|~"], "answer": 0},
    {"question": "for i in", "choices": [" range(", "~`^|~`"], "answer": 0},
    {"question": "if x is", "choices": [" not None", " ^~`|^`~|"], "answer": 0},
    {"question": "class Foo", "choices": ["(object):", "`~^|~^`|~"], "answer": 0},
]
LL_DOCS = [{"context": "import ", "continuation": "os"}, {"context": "    return ", "continuation": "self"},
           {"context": "from . import ", "continuation": "_"}, {"context": "def __init__(", "continuation": "self"}]

MC_YAML = f"""task: {MC_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""
LL_YAML = f"""task: {LL_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: ll.jsonl
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
"""


def write_task_files(directory: Path) -> tuple[Path, Path]:
    """(multiple-choice task file, loglikelihood task file) in ``directory``, their data relative to them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (directory / "ll.jsonl").write_text("".join(json.dumps(d) + "\n" for d in LL_DOCS))
    (directory / "mc.yaml").write_text(MC_YAML)
    (directory / "ll.yaml").write_text(LL_YAML)
    return directory / "mc.yaml", directory / "ll.yaml"
