"""A FIFO where quantkit reads its own cache or a user's image folder: passed over (a cache entry) or refused in one
line (an image, a source's weights), never opened. A plain ``open`` waited for ever for a writer there.

Each FIFO here has a writer (:func:`fed_fifo`): a reader that opens it gets the writer's bytes at once instead of
hanging the suite, so a reader that still opens it fails on what it read (a forged cache entry taken, a FIFO
taken for an image) and on :data:`opened`, never on a clock. The writer is let go at the end through a second
name of the same FIFO, so it ends whether or not quantkit replaced the first name meanwhile."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from quantkit import cache, file_hashes, images, token_cache
from quantkit.errors import CalibrationError, SourceModelError
from quantkit.producers import mixed, sensitivity, vision
from quantkit.producers.gguf import tools
from quantkit.tasks import baseline

pytestmark = pytest.mark.unit


@contextlib.contextmanager
def fed_fifo(path: Path, data: bytes) -> Iterator[threading.Event]:
    """A FIFO at ``path`` whose writer (a thread) gives ``data`` to the first reader that opens it; yields the event
    set once one did. At the end a reader of the test's own opens it through a hard link, without blocking, which
    lets a writer still waiting go (its bytes go to that reader, or nowhere)."""
    os.mkfifo(path)
    spare = path.parent / f".{path.name}.spare"
    os.link(path, spare)
    opened = threading.Event()

    def write() -> None:
        try:
            with open(spare, "wb") as f:  # blocks until a reader opens the FIFO, by either name
                opened.set()
                f.write(data)
        except BrokenPipeError:  # the test's reader went first and was closed before the writer wrote
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield opened
    finally:
        fd = os.open(spare, os.O_RDONLY | os.O_NONBLOCK)
        try:
            writer.join()
        finally:
            os.close(fd)
            spare.unlink()


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """quantkit's cache in a folder of the test's own."""
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_fifo_at_a_file_hash_entry_is_no_entry(tmp_path: Path, cache_dir: Path) -> None:
    """The weights' sha256 cache (quantkit.file_hashes): a FIFO at the entry of a file's version is passed over, the
    file hashed again and the entry written in its place; a plain read took the forged digest it was fed as the
    weights' (what says an artifact came from these weights)."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"the weights")
    real = hashlib.sha256(b"the weights").hexdigest()
    assert file_hashes.sha256s([weights]) == {weights: real}
    [entry] = list(cache.folder(file_hashes.FOLDER).iterdir())
    entry.unlink()
    with fed_fifo(entry, b"0" * 64) as opened:
        assert file_hashes.sha256s([weights]) == {weights: real}
        assert not opened.is_set()
    assert entry.is_file() and entry.read_text() == real


def test_a_fifo_at_a_calibration_token_entry_is_no_entry(cache_dir: Path) -> None:
    """The calibration token cache (quantkit.token_cache.read): a FIFO at the entry is no entry (tokenized again),
    where a plain read took the tokens it was fed."""
    fed = {"samples": [[1, 2, 3]], "chat": False, "tokens_sha256": "d" * 64}
    with fed_fifo(token_cache.path("entry"), json.dumps(fed).encode()) as opened:
        assert token_cache.read("entry", lambda samples: "d" * 64) is None
        assert not opened.is_set()


def test_a_fifo_at_a_baseline_scores_entry_is_no_entry(cache_dir: Path) -> None:
    """The baseline's task scores (quantkit.tasks.baseline.load): a FIFO at the entry is no entry (scored again),
    where a plain read took the scores it was fed for the baseline's."""
    fed = {"values": {"arc_easy": {"acc": [0.99, 0.01]}}, "samples": {"arc_easy": 10},
           "num_fewshot": {"arc_easy": 0}, "engine": {"name": "transformers"}, "seconds": 1.0}
    with fed_fifo(cache.folder(baseline.FOLDER) / "entry.json", json.dumps(fed).encode()) as opened:
        assert baseline.load("entry") is None
        assert not opened.is_set()


def test_a_fifo_at_a_sensitivity_entry_is_no_entry(cache_dir: Path) -> None:
    """A bits target's sensitivity measurement (quantkit.producers.sensitivity.read): a FIFO at the entry is no
    entry (measured again), where a plain read took the KLDs it was fed."""
    unit = mixed.Unit("layers.0.mlp", ("layers.0.mlp.up_proj",), 64, 8, 0.5)
    fed = {"units": [{"name": unit.name, "modules": list(unit.modules), "params": 64, "in_features": 8, "kld": 0.5}],
           "sensitivity": {"tokens": 16}}
    with fed_fifo(cache.folder("sensitivity") / "entry.json", json.dumps(fed).encode()) as opened:
        assert sensitivity.read("entry", [unit]) is None
        assert not opened.is_set()


def test_a_fifo_at_a_llama_tools_build_json_is_none(tmp_path: Path) -> None:
    """The ``BUILD.json`` beside llama.cpp's tools in quantkit's cache, or in a folder ``$QUANTKIT_LLAMACPP_BIN``
    names (quantkit.producers.gguf.tools.build_info, which ``doctor`` and a GGUF build's manifest read): a FIFO
    there is no build record, where a plain read hung ``doctor``; a record that is no JSON object is none either."""
    bin_dir = tmp_path / "llama-tools" / "b1" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-quantize").write_text("#!/bin/sh\n")
    build = bin_dir.parent / "BUILD.json"
    fed = {"build_number": 1, "commit": "0" * 40, "llama_cpp_python": "0.3.16"}
    with fed_fifo(build, json.dumps(fed).encode()) as opened:
        assert tools.build_info(bin_dir / "llama-quantize") is None
        assert not opened.is_set()
    build.unlink()
    build.write_text("[1, 2]")
    assert tools.build_info(bin_dir / "llama-quantize") is None
    build.write_text(json.dumps(fed))
    assert tools.build_info(bin_dir / "llama-quantize") == fed


def test_a_fifo_in_an_image_folder_is_refused(tmp_path: Path) -> None:
    """``--calib-images FOLDER`` (quantkit.images.load): an image that is a FIFO, or a ``captions.json`` that is
    one, is refused in one line naming it (exit 2, the calibration's fault), never opened; a plain read of the
    image waited for a writer, and the captions' FIFO was passed over as no captions at all. A picture read again
    (an engine's ``data:`` URL, the processor's PIL image) is opened the same way."""
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"\x89PNG not really")
    with fed_fifo(folder / "b.png", b"\x89PNG fed") as opened:
        with pytest.raises(CalibrationError, match=f"^{re.escape(str(folder / 'b.png'))} is a FIFO, not a file"):
            images.load(folder)
        picture = images.Picture(folder / "b.png", "0" * 64)
        with pytest.raises(CalibrationError, match="is a FIFO, not a file"):
            picture.data_url()
        with pytest.raises(CalibrationError, match="is a FIFO, not a file"):
            picture.open()
        assert not opened.is_set()
    (folder / "b.png").unlink()
    captions = folder / "captions.json"
    with fed_fifo(captions, b"{}") as opened:
        with pytest.raises(CalibrationError, match=f"^{re.escape(str(captions))} is a FIFO, not a file"):
            images.load(folder)
        assert not opened.is_set()


def test_a_source_weight_file_read_again_for_the_vision_check_is_opened_as_a_users_file(tmp_path: Path) -> None:
    """The vision tower's tensors are hashed (quantkit.producers.vision._digest) by opening the source's weight
    file again after its header was read: one swapped for a FIFO meanwhile is refused (exit 2, naming it), where a
    plain open waited for a writer."""
    with fed_fifo(tmp_path / "model.safetensors", b"12345678") as opened:
        with pytest.raises(SourceModelError, match="model.safetensors is a FIFO, not a file"):
            vision._digest(tmp_path / "model.safetensors", {"data_offsets": [0, 4]}, 0)
        assert not opened.is_set()
