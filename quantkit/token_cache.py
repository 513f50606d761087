"""The calibration token cache: a second run of the same recipe reuses its calibration tokens instead of
tokenizing its documents again (issue 44: quantkit's fixed cost per run).

An entry lives under ``quantkit.cache.folder("calibration")``, named by the sha256 of everything that decides its
tokens (:func:`key`): the calibration spec (source, field, samples, seq_len, seed, chat-template setting, images),
the source documents' sha256, the sha256 of every tokenizer file of the model (its chat template included), the
tokenizers and transformers versions, and :data:`LAYOUT`, the version of the way quantkit packs tokens. A source
whose documents have no sha256 (a hub dataset without a fingerprint) or a tokenizer that is not a local folder is
not cached. An entry is read back only whole (``cache.write_atomic``) and only when its tokens still hash to the
sha256 it recorded; anything else is recomputed.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from quantkit import cache

LAYOUT = 3  # bump when calibration.build makes other tokens from the same inputs (2: no UTF-8 BOM; 3: a null
# record does not make a file of conversations plain text)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")


def tokenizer_sha256(folder: Path) -> str | None:
    """sha256 over the tokenizer files of the folder a tokenizer is loaded from (None where it is not a local
    folder, or the folder holds none of them): named by its files, not by a loaded tokenizer, so the calibration
    check (:func:`quantkit.calibration.check`) finds an entry without loading one."""
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            found = True
            h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest() if found else None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def key(spec: dict[str, Any], source_sha256: str | None, tokenizer_folder: Path) -> str | None:
    """The entry's name for these inputs, or None where they cannot be named (then nothing is cached)."""
    tok = tokenizer_sha256(tokenizer_folder)
    if source_sha256 is None or tok is None:
        return None
    data = {"layout": LAYOUT, "spec": spec, "source_sha256": source_sha256, "tokenizer_sha256": tok,
            "tokenizers": _version("tokenizers"), "transformers": _version("transformers")}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def path(name: str) -> Path:
    return cache.folder("calibration") / f"{name}.json"


def read(name: str, tokens_sha256: Any) -> tuple[list[list[int]], bool, str] | None:
    """The cached (samples, chat, tokens sha256) of entry ``name``, or None when there is no sound entry:
    ``tokens_sha256(samples)`` (the caller's hash function) must give the sha256 the entry recorded."""
    entry = cache.read_json(path(name))  # a FIFO or a device at the name is no entry, never waited on
    if entry is None:
        return None
    try:
        samples, chat, digest = entry["samples"], bool(entry["chat"]), str(entry["tokens_sha256"])
    except (KeyError, TypeError):
        return None
    if not isinstance(samples, list) or tokens_sha256(samples) != digest:
        return None
    return samples, chat, digest


def write(name: str, samples: list[list[int]], chat: bool, digest: str) -> None:
    """Store an entry (whole or not at all; a cache that cannot be written is only a slower next run)."""
    try:
        cache.write_atomic(path(name), json.dumps({"samples": samples, "chat": chat, "tokens_sha256": digest},
                                                  separators=(",", ":")).encode())
    except OSError:
        pass
