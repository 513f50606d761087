"""The baseline's task scores, cached so a release of N artifacts (or a second ``eval`` of the same source) scores
the baseline once.

An entry is one task's scores under ``quantkit.cache.folder("tasks")``, keyed by everything that decides them: the
source's identity, the task's sha256, the engine (and device), few-shot count, limit, seed and lm-eval's version.
The source's identity is what the manifest records of it, its ``config.json``'s sha256 and its weights' (every
byte, hashed once per version of each file: :mod:`quantkit.file_hashes`), and its tokenizer files' sha256.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from quantkit import cache
from quantkit.source import SourceModel
from quantkit.tasks.resolve import LM_EVAL, Task
from quantkit.tasks.runner import Scores

FOLDER = "tasks"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "chat_template.jinja", "vocab.json", "merges.txt")


def identity(src: SourceModel) -> dict[str, Any]:
    """The source model as the cache key sees it (see the module docstring)."""
    return {"config_sha256": src.config_sha256,
            "tokenizer": {n: hashlib.sha256((src.path / n).read_bytes()).hexdigest()
                          for n in _TOKENIZER_FILES if (src.path / n).is_file()},
            "weights_sha256": src.weights_sha256()}


def key(source: dict[str, Any], task: Task, engine: dict[str, Any], settings: dict[str, Any]) -> str:
    """The entry's name: sha256 over the source's identity, the task, the engine and the settings."""
    from importlib.metadata import version

    data = {"source": source, "task": task.sha256, "name": task.name, "num_fewshot": task.spec.num_fewshot,
            "limit": task.spec.limit, "engine": engine, "settings": settings, "lm_eval": version(LM_EVAL)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def load(name: str) -> Scores | None:
    """A cached entry, or None when there is none or it cannot be read (then it is scored again)."""
    entry = cache.read_json(cache.folder(FOLDER) / f"{name}.json")  # a FIFO or a device: none, never waited on
    if entry is None:
        return None
    try:
        return Scores.from_json(entry)
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def save(name: str, scores: Scores) -> None:
    cache.write_atomic(cache.folder(FOLDER) / f"{name}.json", json.dumps(scores.to_json(), sort_keys=True).encode())
