"""Calibration files as people have them: a JSON array of records (.json, .json.gz) read as its .jsonl is, and a set
whose documents repeat, said (never dropped) by ``calib show``, the dry run and the run."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from quantkit import calibration
from quantkit.errors import CalibrationError
from quantkit.recipe import CalibrationSpec

pytestmark = pytest.mark.unit

TEXTS = [f"Document number {i}. " + "The quick brown fox jumps over the lazy dog. " * (20 + i) for i in range(12)]
CHATS = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
         for i in range(6)]
RECORDS = {  # record kind -> (the records, the text field that reads them)
    "text": ([{"text": t, "id": i} for i, t in enumerate(TEXTS)], "text"),
    "field": ([{"body": t} for t in TEXTS], "body"),
    "chat": ([{"messages": m} for m in CHATS], "text"),
}


@pytest.fixture(scope="module")
def tok(tiny: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def _write(path: Path, text: str) -> Path:
    data = text.encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def _jsonl(path: Path, records: list) -> Path:
    return _write(path, "".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
@pytest.mark.parametrize("kind", RECORDS)
def test_a_json_array_is_read_as_its_jsonl(tmp_path: Path, kind: str, suffix: str) -> None:
    """The same records, as a JSON array (``datasets``' ``to_json(lines=False)``, or saved by hand) and as JSON
    Lines: the same documents, of the same kind, by the same field rule."""
    records, field = RECORDS[kind]
    lines = calibration.load_documents(str(_jsonl(tmp_path / "a.jsonl", records)), field)
    array = calibration.load_documents(str(_write(tmp_path / f"a{suffix}", json.dumps(records, indent=1))), field)
    assert array.items == lines.items and array.chat == lines.chat == (kind == "chat")
    assert array.kind == "file" and array.file_sha256 is not None


def test_datasets_to_json_is_read_either_way(tmp_path: Path, tok, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``datasets`` writes: ``to_json(lines=False)`` a JSON array, its default a record per line (in a .json
    too); both give the tokens the .jsonl gives, each tokenized here (a token cache of the test's own)."""
    from datasets import Dataset

    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "cache"))
    ds = Dataset.from_dict({"text": TEXTS})
    ds.to_json(tmp_path / "array.json", lines=False)
    ds.to_json(tmp_path / "lines.json")
    assert (tmp_path / "array.json").read_text().startswith("[")
    spec = CalibrationSpec(dataset=str(tmp_path / "a.jsonl"), samples=4, seq_len=64)
    want = calibration.build(spec, tok, calibration.load_documents(str(_jsonl(tmp_path / "a.jsonl",
                                                                               RECORDS["text"][0]))))
    for name in ("array.json", "lines.json"):
        got = calibration.build(spec.model_copy(update={"dataset": str(tmp_path / name)}), tok)
        assert got.tokens_sha256 == want.tokens_sha256, name


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_a_bad_record_of_a_json_array_is_named_by_its_index(tmp_path: Path, suffix: str) -> None:
    """Where a .jsonl names the line, a JSON array names the record; a missing field names the flags, as there."""
    bad = _write(tmp_path / f"bad{suffix}", json.dumps([{"text": "fine"}, {"text": 5}]))
    with pytest.raises(CalibrationError, match=rf"bad{suffix}: record 2: 'text' is 5 \(int\)"):
        calibration.load_documents(str(bad))
    other = _write(tmp_path / f"other{suffix}", json.dumps([{"text": "fine"}, {"body": "x"}]))
    with pytest.raises(calibration.FieldError, match=r"record 2: no 'text' field \(fields: body\)") as e:
        calibration.load_documents(str(other))
    assert "--calib-field" in e.value.hint


@pytest.mark.parametrize("top, found", [({"text": "one record"}, "an object (keys: text)"),
                                        ("just a string", "a string"), (42, "a number")])
@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_a_json_file_that_is_no_array_says_what_it_found(tmp_path: Path, suffix: str, top: object,
                                                         found: str) -> None:
    path = _write(tmp_path / f"top{suffix}", json.dumps(top))
    with pytest.raises(CalibrationError) as e:
        calibration.load_documents(str(path))
    assert e.value.message.startswith(f"{path}: the top level is {found}; expected a JSON array of records"), e.value
    assert "\n" not in e.value.message and ".jsonl" in e.value.hint


@pytest.mark.parametrize("name", ["calib.json", "calib.json.gz"])
def test_a_fifo_named_json_is_refused_not_waited_on(tmp_path: Path, name: str) -> None:
    os.mkfifo(tmp_path / name)
    with pytest.raises(CalibrationError, match="is not a regular file"):
        calibration.load_documents(str(tmp_path / name))


@pytest.mark.cli
def test_calib_show_and_a_recipe_dry_run_read_a_json_gz(cli, tiny: Path, tmp_path: Path) -> None:
    """``calib show`` previews a .json.gz, and a recipe's ``calibration.dataset`` naming one passes ``run
    --dry-run``, its documents read and tokenized by the check."""
    _write(tmp_path / "calib.json.gz", json.dumps(RECORDS["text"][0]))
    info = json.loads(cli("calib", "show", tmp_path / "calib.json.gz", "--json", check=True).stdout)
    assert info["documents"] == len(TEXTS) and info["preview"][0].startswith("Document number 0")
    (tmp_path / "r.yaml").write_text(f"model: {{source: {tiny}}}\noutput: out\nquantize: {{method: gptq}}\n"
                                     "calibration: {dataset: calib.json.gz, samples: 2, seq_len: 64}\n"
                                     "evaluation: {enabled: false}\nsmoke: {enabled: false}\n")
    proc = cli("run", "r.yaml", "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (planned,) = json.loads(proc.stdout)["outputs"]
    assert f"{len(TEXTS)} documents checked" in planned["calibration"], planned


def test_repeated_documents_are_counted_after_the_loaders_normalisation(tmp_path: Path) -> None:
    """A document equal to an earlier one, as the loader reads it (a .txt block without its surrounding blank
    space, line ends as LF), counts; empty documents are no documents; a repeated conversation counts too."""
    txt = tmp_path / "a.txt"
    txt.write_bytes(b"alpha\r\n\r\nbeta\n\n  alpha  \n\n\n\nalpha\n")
    docs = calibration.load_documents(str(txt))
    assert docs.items == ["alpha", "beta", "alpha", "alpha"] and calibration.repeated(docs) == 2
    chats = _jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[1]}, {"messages": CHATS[0]},
                                          {"messages": None}])
    assert calibration.repeated(calibration.load_documents(str(chats))) == 1
    assert calibration.repeated(calibration.load_documents("mixed")) == 0  # the shipped sets repeat nothing


@pytest.mark.cli
def test_calib_show_and_the_dry_run_say_how_many_documents_repeat(cli, tiny: Path, tmp_path: Path) -> None:
    """A set saved with three documents twice: said by ``calib show`` (and its --json) and the plan's calibration
    column, before anything is made."""
    _jsonl(tmp_path / "dup.jsonl", [{"text": t} for t in TEXTS + TEXTS[:3]])
    proc = cli("calib", "show", tmp_path / "dup.jsonl", "--show", "0", check=True)
    assert "3 of 15 documents repeat an earlier one" in proc.stdout, proc.stdout
    assert json.loads(cli("calib", "show", tmp_path / "dup.jsonl", "--json", check=True).stdout)["repeated"] == 3
    proc = cli("gptq", tiny, tmp_path / "out", "--calib", "dup.jsonl", "--samples", "2", "--seq-len", "64",
               "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 of 15 repeat an earlier one" in json.loads(proc.stdout)["outputs"][0]["calibration"]


@pytest.mark.cli
def test_a_run_on_repeated_documents_warns_once_and_uses_them(cli, tiny: Path, tmp_path: Path) -> None:
    """The build says it in one warning line (fp8 static: a calibrating method that is quick on CPU), and makes the
    artifact from the documents as they are."""
    _jsonl(tmp_path / "dup.jsonl", [{"text": t} for t in TEXTS + TEXTS[:3]])
    proc = cli("fp8", tiny, tmp_path / "out", "--calib", "dup.jsonl", "--samples", "2", "--seq-len", "64",
               "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert warnings == ["warning: calibration source 'dup.jsonl': 3 of 15 documents repeat an earlier one; they "
                        "are used as they are, so each weighs more"], proc.stderr[-2000:]
    (made,) = json.loads(proc.stdout)
    assert made["calibration"]["samples"] == 2, made
