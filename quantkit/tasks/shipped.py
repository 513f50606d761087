"""The tasks quantkit ships (``data/<name>/``: lm-eval's YAML reading a local ``test.jsonl``), built by
``scripts/build_tasks.py`` from the held-out documentation text; ``data/README.md`` says how and under which licence."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
LASTWORD = "quantkit_lastword"  # loglikelihood: acc
NEXTSENTENCE = "quantkit_nextsentence"  # multiple_choice: acc, acc_norm
LASTWORD_GEN = "quantkit_lastword_gen"  # generate_until: exact_match (llama-server scores it)
NAMES = (LASTWORD, NEXTSENTENCE, LASTWORD_GEN)


def path(name: str) -> Path | None:
    """The YAML of the shipped task called ``name``, or None when quantkit ships no such task."""
    return DATA / name / f"{name}.yaml" if name in NAMES else None
