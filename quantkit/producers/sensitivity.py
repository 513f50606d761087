"""The bits target's sensitivity measurement kept between runs: a second run of the same recipe on the same source
and calibration reads each layer group's KLD back instead of measuring it again (one forward pass per layer group:
most of a bits target's time on a CPU, 350 s of SmolLM2-135M's 11 minutes).

An entry is ``cache.folder("sensitivity")/<key>.json``: the units as :func:`quantkit.producers.mixed.measure` left
them (name, modules, parameters, input width, KLD) and its record of the measurement. Its key is the sha256 of
everything that decides those numbers (:func:`key`):

* the source as the manifest records it: its config.json's sha256, its revision and its weights' sha256 (every
  byte, hashed once per version of each file: :mod:`quantkit.file_hashes`), so another checkpoint with the same
  config (a fine-tune of the same base), or the same folder with its weights replaced, is another key;
* the calibration tokens' sha256 (the manifest's ``calibration.tokens_sha256``);
* the low precision the units are measured at (its format, group size, symmetry and scales; the round-to-nearest
  min-max proxy is the same whatever the method and observer), the tokens measured and scored, the units measured;
* where and how the model ran (the load dtype, cpu or cuda) and the versions of quantkit and of the libraries that
  compute it (torch, transformers, compressed-tensors), with :data:`ENTRY`, raised when the measurement changes.

Written whole or not at all (:func:`quantkit.cache.write_atomic`); an entry that cannot be read, or whose units are
not the ones this run found, is measured again and replaced.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from quantkit import cache, versions
from quantkit.producers import mixed
from quantkit.source import SourceModel

ENTRY = 1  # raised whenever mixed.measure computes something else for the same inputs
LIBRARIES = ("quantkit", "torch", "transformers", "compressed-tensors")


def key(source: SourceModel, tokens_sha256: str, low: mixed.Precision, found: list[mixed.Unit], dtype: str,
        device: str) -> str:
    """The entry's name: the sha256 of what decides the measurement (the module docstring's list)."""
    fields = {"entry": ENTRY, "config_sha256": source.config_sha256, "revision": source.revision,
              "weights_sha256": source.weights_sha256(), "calibration_tokens_sha256": tokens_sha256, "low": asdict(low),
              "tokens": mixed.SENSITIVITY_TOKENS, "score_every": mixed.SCORE_EVERY,
              "units": [[u.name, list(u.modules)] for u in found], "dtype": dtype, "device": device,
              "versions": {d: versions.version(d) for d in LIBRARIES}}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def read(name: str, found: list[mixed.Unit]) -> tuple[list[mixed.Unit], dict[str, Any]] | None:
    """The measured units and their record under ``name``, or None when there is no usable entry (missing,
    unreadable, or not these units: then it is measured again)."""
    entry = cache.read_json(cache.folder("sensitivity") / f"{name}.json")  # a FIFO or a device: none, never waited on
    if entry is None:
        return None
    try:
        measured = [mixed.Unit(u["name"], tuple(u["modules"]), int(u["params"]), int(u["in_features"]),
                               float(u["kld"])) for u in entry["units"]]
        record = dict(entry["sensitivity"])
    except (ValueError, KeyError, TypeError):
        return None
    if [(u.name, u.modules, u.params) for u in measured] != [(u.name, u.modules, u.params) for u in found]:
        return None
    return measured, record


def write(name: str, measured: list[mixed.Unit], record: dict[str, Any]) -> None:
    """Keep a measurement under ``name`` (whole or not at all)."""
    entry = {"entry": ENTRY, "units": [{k: v for k, v in asdict(u).items() if k != "bits"} for u in measured],
             "sensitivity": record}
    cache.write_atomic(cache.folder("sensitivity") / f"{name}.json", json.dumps(entry).encode())
