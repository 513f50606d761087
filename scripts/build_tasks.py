"""Build quantkit's shipped lm-eval tasks from the held-out documentation text (deterministic: same input, same files).

    .venv/bin/python scripts/build_tasks.py            # rewrites quantkit/tasks/data/*/

The input is ``calibration/heldout.jsonl.gz``: the reference model's held-out split of the Python 3.11 documentation
(the Python Software Foundation's work under the PSF License Agreement, ``calibration/LICENSE-PSF.txt``). Only the
documentation pages are read (not the standard library's code); from their paragraphs, plain English sentences are
kept: 8 to 32 words, letters and ordinary punctuation only (no reStructuredText roles, literals or code), ending in a
full stop, whose last word is alphabetic and at least 3 letters long. Each task takes at most ``ITEMS`` of them,
in document order.

Three tasks, each a folder with the task's YAML in lm-eval's own format (``dataset_path: json`` reading the local
``test.jsonl``) and the data:

* ``quantkit_lastword`` (loglikelihood; acc): is the sentence's last word the model's greedy continuation?
* ``quantkit_nextsentence`` (multiple_choice; acc, acc_norm): which of four sentences follows a sentence in its
  document: the true one, and three from other documents picked by a seeded generator;
* ``quantkit_lastword_gen`` (generate_until; exact_match): the same sentences, the last word generated greedily and
  its first word compared: a generation task, which llama-server scores (it refuses ``echo``, so no loglikelihood).
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "calibration" / "heldout.jsonl.gz"
OUT = ROOT / "quantkit" / "tasks" / "data"
ITEMS = 300
SEED = 0

_PLAIN = re.compile(r"^[A-Z][A-Za-z ,;'()-]+[A-Za-z]\.$")
_SENTENCE_END = re.compile(r"(?<=[a-z]\.)\s+(?=[A-Z])")


def sentences(text: str) -> list[str]:
    """The plain sentences of a reStructuredText page, in order (see the module docstring for what is kept)."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        if para.startswith((" ", "..", ":", "=", "-", "*")):
            continue  # indented blocks (code, directives' bodies), directives, headings' rules, lists
        flat = " ".join(para.split())
        for s in _SENTENCE_END.split(flat):
            words = s.split()
            last = words[-1].rstrip(".") if words else ""
            if _PLAIN.match(s) and 8 <= len(words) <= 32 and last.isalpha() and len(last) >= 3:
                out.append(s)
    return out


def documents() -> list[tuple[str, list[str]]]:
    """(source, its sentences) of each held-out documentation page that has any."""
    with gzip.open(HELDOUT, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    docs = [(r["source"], sentences(r["text"])) for r in rows if r["source"].startswith("python-docs/")]
    return [(src, ss) for src, ss in docs if ss]


def last_word_items(docs: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """Each sentence split before its last word: ``context`` ends without a space, ``target`` is the word."""
    items = []
    for src, ss in docs:
        for s in ss:
            head, word = s[:-1].rsplit(" ", 1)
            items.append({"source": src, "context": head, "target": word})
    return items[:ITEMS]


def next_sentence_items(docs: list[tuple[str, list[str]]]) -> list[dict[str, object]]:
    """A sentence, the one after it in its page, and three sentences of other pages, in a seeded order."""
    rng = random.Random(SEED)
    items: list[dict[str, object]] = []
    for i, (src, ss) in enumerate(docs):
        others = [s for j, (_, o) in enumerate(docs) if j != i for s in o]
        for a, b in zip(ss, ss[1:]):
            choices = [b] + rng.sample(others, 3)
            rng.shuffle(choices)
            items.append({"source": src, "context": a, "choices": choices, "label": choices.index(b)})
    return items[:ITEMS]


COMMON = {"dataset_path": "json", "test_split": "train", "dataset_kwargs": {"data_files": {"train": "test.jsonl"}},
          "metadata": {"version": 1.0, "license": "PSF-2.0", "built_by": "scripts/build_tasks.py"}}

TASKS: dict[str, dict[str, object]] = {
    "quantkit_lastword": {
        "output_type": "loglikelihood", "doc_to_text": "{{context}}", "doc_to_target": " {{target}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    "quantkit_nextsentence": {
        "output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}", "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]},
    "quantkit_lastword_gen": {
        "output_type": "generate_until", "doc_to_text": "{{context}}", "doc_to_target": "{{target}}",
        "generation_kwargs": {"until": ["\n", ".", ","], "max_gen_toks": 6, "do_sample": False, "temperature": 0.0},
        "filter_list": [{"name": "first-word", "filter": [
            {"function": "regex", "regex_pattern": r"([A-Za-z]+)", "group_select": 0}, {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True}]},
}


def write_task(name: str, items: list[dict[str, object]]) -> None:
    """The task's folder: its YAML (JSON is YAML; sorted keys, so the bytes are stable) and ``test.jsonl``."""
    import yaml

    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    config = {"task": name, **COMMON, **TASKS[name]}
    (folder / f"{name}.yaml").write_text(
        f"# {name}: built by scripts/build_tasks.py from calibration/heldout.jsonl.gz (PSF-2.0); see README.md\n"
        + yaml.safe_dump(config, sort_keys=True, width=120))
    (folder / "test.jsonl").write_text("".join(json.dumps(it, ensure_ascii=False, sort_keys=True) + "\n"
                                               for it in items))
    print(f"{name}: {len(items)} items -> {folder.relative_to(ROOT)}")


def main() -> None:
    docs = documents()
    words = last_word_items(docs)
    write_task("quantkit_lastword", words)
    write_task("quantkit_lastword_gen", words)
    write_task("quantkit_nextsentence", next_sentence_items(docs))


if __name__ == "__main__":
    main()
