"""Writes the task configs of this directory from ``kvzap evaluate``'s datasets (run after adding a task):
``python kvzap/harness/tasks/_write_configs.py``. A test checks that the committed files are what it writes."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

TEMPLATE = """\
task: {name}
tag: [kvzap]
dataset_path: json
custom_dataset: !function utils.load_local
dataset_kwargs:
  benchmark: {benchmark}
  task: {task}
output_type: generate_until
test_split: test
doc_to_text: "{{{{context}}}}\\n{{{{question}}}}\\n{{{{answer_prefix}}}}"
doc_to_target: "{{{{answers[0]}}}}"
process_results: !function utils.process_results
metric_list:
  - metric: score
    aggregation: mean
    higher_is_better: true
generation_kwargs:
{generation}
metadata:
  version: 1.0
"""

GROUP = """\
group: {group}
task:
{tasks}
aggregate_metric_list:
  - metric: score
    aggregation: mean
    weight_by_size: true
metadata:
  version: 1.0
"""


def configs() -> dict[str, str]:
    """File name -> content of every config."""
    from kvzap.evaluation import aime, longbench, ruler
    from kvzap.evaluation.benchmarks import BENCHMARKS, RULER_HUB_TASKS

    greedy = "  until: []\n  do_sample: false\n  max_gen_toks: {}"
    sampled = "  until: []\n  do_sample: true\n  temperature: 0.6\n  top_p: 0.95\n  top_k: 20\n  max_gen_toks: {}"
    budgets = {
        "ruler_offline": {t: spec.max_new_tokens for t, spec in ruler.TASKS.items()},
        "ruler": {t: 128 for t in RULER_HUB_TASKS},
        "longbench": {t: spec.max_new_tokens for t, spec in longbench.TASKS.items()},
        "aime25": {aime.TASK: aime.MAX_NEW_TOKENS},
    }
    files = {}
    for benchmark, tasks in budgets.items():
        names = []
        for task, budget in tasks.items():
            name = f"kvzap_{benchmark}_{task}"
            generation = (sampled if BENCHMARKS[benchmark].sampled else greedy).format(budget)
            files[f"{name}.yaml"] = TEMPLATE.format(name=name, benchmark=benchmark, task=task, generation=generation)
            names.append(name)
        if len(names) > 1:
            listed = "\n".join(f"  - {n}" for n in names)
            files[f"kvzap_{benchmark}.yaml"] = GROUP.format(group=f"kvzap_{benchmark}", tasks=listed)
    return files


if __name__ == "__main__":
    for old in HERE.glob("kvzap_*.yaml"):
        old.unlink()
    for file, text in configs().items():
        (HERE / file).write_text(text, encoding="utf-8")
