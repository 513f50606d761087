"""The calibration token cache (quantkit.token_cache): a second run of the same calibration reuses its tokens, says
so in the manifest's calibration record with the same token sha256, and anything that changes the tokens (the seed,
a tokenizer file) or a damaged entry misses. Real tokenizer, real shipped documents, a cache folder of the test's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import TINY
from quantkit import api, cache, calibration
from quantkit.recipe import CalibrationSpec

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_second_run_reuses_the_tokens_and_says_so() -> None:
    first = api.preview_calibration("mixed", model=str(TINY), samples=4, seq_len=64)["calibration"]
    second = api.preview_calibration("mixed", model=str(TINY), samples=4, seq_len=64)["calibration"]
    assert first["tokens_reused"] is False and second["tokens_reused"] is True
    assert second["tokens_sha256"] == first["tokens_sha256"] and second["tokens"] == first["tokens"] == 4 * 64
    assert len(list(cache.folder("calibration").glob("*.json"))) == 1


def test_a_changed_seed_or_tokenizer_misses(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(TINY)
    spec = CalibrationSpec(samples=4, seq_len=64)
    made = calibration.build(spec, tok)
    assert calibration.build(spec, tok).reused
    reseeded = calibration.build(spec.model_copy(update={"seed": 1}), tok)
    assert not reseeded.reused and reseeded.tokens_sha256 != made.tokens_sha256
    copy = tmp_path / "tok"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, copy / name)
    with open(copy / "tokenizer_config.json", "a") as f:
        f.write("\n")  # the same tokenizer to the byte but one: its files decide, not what they happen to mean
    other = calibration.build(spec, AutoTokenizer.from_pretrained(copy))
    assert not other.reused and other.tokens_sha256 == made.tokens_sha256


def test_a_damaged_entry_is_made_again() -> None:
    tok = AutoTokenizer.from_pretrained(TINY)
    spec = CalibrationSpec(samples=2, seq_len=32)
    made = calibration.build(spec, tok)
    (entry,) = cache.folder("calibration").glob("*.json")
    entry.write_text(entry.read_text().replace("[[", "[[7,", 1))  # tokens that no longer hash to the recorded sha256
    again = calibration.build(spec, tok)
    assert not again.reused and again.samples == made.samples
    assert calibration.build(spec, tok).reused  # and the entry was written whole again


def test_a_run_tokenizes_its_calibration_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check before anything loads (:func:`quantkit.calibration.check`, the one --dry-run runs) tokenizes the
    documents; the build right after takes those samples instead of tokenizing them again, and they are the run's
    own (not "reused"), and written to the cache for the next run."""
    from quantkit import source

    calls = []
    real = calibration._tokenize
    monkeypatch.setattr(calibration, "_tokenize", lambda *a: (calls.append(1), real(*a))[1])
    spec = CalibrationSpec(samples=4, seq_len=64)
    calibration.check(spec, source.vet(TINY))
    made = calibration.build(spec, AutoTokenizer.from_pretrained(TINY))
    assert len(calls) == 1 and not made.reused
    assert calibration.build(spec, AutoTokenizer.from_pretrained(TINY)).reused and len(calls) == 1
