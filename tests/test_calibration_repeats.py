"""Calibration documents that repeat an earlier one: counted in the artifact's manifest (so a release pipeline can gate
on ``quantkit.json``) and shown by ``inspect``, and warned of once, before the quantizer starts rather than after it has
finished, a hub dataset's too.

Real ``quantkit`` processes on the reference model; FP8 static and INT8 with round-to-nearest weights are the
calibrating methods that are quick on CPU. The hub cannot be reached here: a hub dataset is one ``datasets`` prepared
into the layout its cache keeps a hub download in, which quantkit's hub reader (``datasets.load_dataset`` of
``org/name``, offline) reads as it reads a cached hub dataset."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from quantkit.manifest import MANIFEST

pytestmark = pytest.mark.cli

TEXTS = [f"Document number {i}. " + "The quick brown fox jumps over the lazy dog. " * (20 + i) for i in range(12)]
WARNING = ("warning: calibration source 'dup.jsonl': 3 of 15 documents repeat an earlier one; they are used as they "
           "are, so each weighs more")
BUILD = ("--samples", "2", "--seq-len", "64", "--json")


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning:")]


def _documents_row(out: Path, cli) -> str:
    """What plain ``inspect`` says of the calibration's documents: its "calibration documents" row's value."""
    table = cli("inspect", out, check=True).stdout
    found = re.search(r"calibration documents\s+│ (.+?)\s+│", table)
    assert found, table
    return found.group(1)


@pytest.fixture(scope="module")
def repeated_build(cli, tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``quantkit fp8`` on a set saved with three of its twelve documents twice: the artifact and the run's stderr."""
    work = tmp_path_factory.mktemp("repeats")
    _jsonl(work / "dup.jsonl", TEXTS + TEXTS[:3])
    proc = cli("fp8", tiny, work / "out", "--calib", "dup.jsonl", *BUILD, cwd=work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return work / "out", proc.stderr


def test_the_manifest_counts_the_repeated_documents(repeated_build: tuple[Path, str]) -> None:
    """quantkit.json's calibration section says how many documents were read and how many repeat an earlier one."""
    out, _ = repeated_build
    calib = json.loads((out / MANIFEST).read_text())["calibration"]
    assert (calib["documents"], calib["repeated_documents"]) == (15, 3), calib


def test_the_warning_comes_once_before_the_quantizer_starts(repeated_build: tuple[Path, str]) -> None:
    """One warning line, said before the quantizing step's line: a user watching a long GPTQ learns it at the
    start, not at the end."""
    _, stderr = repeated_build
    lines = stderr.splitlines()
    assert _warnings(stderr) == [WARNING], stderr[-2000:]
    quantizing = next(n for n, ln in enumerate(lines) if ln.startswith("✓ Quantizing"))
    assert lines.index(WARNING) < quantizing, stderr[-2000:]


def test_a_set_without_repeats_records_none_and_warns_nothing(cli, tiny: Path, tmp_path: Path) -> None:
    """Twelve different documents: 0 repeated recorded (not an absent count), and no warning."""
    _jsonl(tmp_path / "clean.jsonl", TEXTS)
    proc = cli("fp8", tiny, tmp_path / "out", "--calib", "clean.jsonl", *BUILD, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _warnings(proc.stderr) == [], proc.stderr[-2000:]
    calib = json.loads((tmp_path / "out" / MANIFEST).read_text())["calibration"]
    assert (calib["documents"], calib["repeated_documents"]) == (12, 0), calib
    assert _documents_row(tmp_path / "out", cli) == "12 (0 repeat an earlier one)"


def test_inspect_shows_the_counts(cli, repeated_build: tuple[Path, str]) -> None:
    """Plain ``inspect`` (not only ``--json``) says how many documents the samples were made from and how many
    repeat an earlier one, as the manifest records them."""
    assert _documents_row(repeated_build[0], cli) == "15 (3 repeat an earlier one)"


def test_a_run_of_two_outputs_on_the_same_set_warns_once(cli, tiny: Path, tmp_path: Path) -> None:
    """``quantkit run`` with two calibrating outputs reading the same documents: one warning for the command, and
    each artifact records the count."""
    _jsonl(tmp_path / "dup.jsonl", TEXTS + TEXTS[:3])
    (tmp_path / "r.yaml").write_text(f"model:\n  source: {tiny}\noutput: rel\noutputs:\n  - method: fp8\n"
                                     "  - method: int8\n    weights: rtn\ncalibration:\n  dataset: dup.jsonl\n"
                                     "  samples: 2\n  seq_len: 64\n")
    proc = cli("run", "r.yaml", "--no-eval", "--no-smoke", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _warnings(proc.stderr) == [WARNING], proc.stderr[-2000:]
    outputs = json.loads(proc.stdout)["outputs"]
    assert [o["status"] for o in outputs] == ["built", "built"], outputs
    for o in outputs:
        assert json.loads((tmp_path / o["path"] / MANIFEST).read_text())["calibration"]["repeated_documents"] == 3


def test_a_manifest_from_before_the_count_still_reads(cli, repeated_build: tuple[Path, str], tmp_path: Path) -> None:
    """An artifact of an earlier quantkit, whose calibration section has neither count: verify passes (the manifest is
    no file of its own seal) and inspect reads the counts as unknown, not as none repeated."""
    out = Path(shutil.copytree(repeated_build[0], tmp_path / "old"))
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["calibration"]["documents"], manifest["calibration"]["repeated_documents"]
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    cli("verify", out, check=True)
    calib = json.loads(cli("inspect", out, "--json", check=True).stdout)["calibration"]
    assert (calib["documents"], calib["repeated_documents"], calib["tokens"]) == (None, None, 128), calib
    assert _documents_row(out, cli) == "unknown (not counted by the quantkit that made this artifact)"


def _cached_hub_dataset(cache: Path, repo_id: str, rows: list[dict[str, str]], staging: Path) -> None:
    """``repo_id`` in ``datasets``' cache as a download from the hub leaves it (``org___name/default/0.0.0/HASH``:
    its ``dataset_info.json`` and ``name-train.arrow``), prepared by ``datasets``' own JSON builder from a local file:
    the hub cannot be reached here, and offline ``datasets.load_dataset(repo_id)`` reads such a folder."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    org, name = repo_id.split("/")
    data = _jsonl(staging / "train.jsonl", [r["text"] for r in rows])
    files = DataFilesDict.from_patterns({"train": [data.name]}, base_path=str(staging))
    builder = Json(cache_dir=str(staging / "build"), dataset_name=name, data_files=files)
    builder.download_and_prepare(output_dir=str(cache / f"{org}___{name}" / "default" / "0.0.0" / "local"))


def test_a_hub_datasets_repeats_are_warned_of_before_the_quantizer_starts(cli, tiny: Path, tmp_path: Path) -> None:
    """A hub dataset, which the check leaves to the run (a dry run stays offline), was read by the producer, so its
    repeats were said after the quantizer had finished. The build now reads its documents before the producer starts,
    once (``datasets`` reads the cache once: one "Found the latest cached dataset" line), and hands them on."""
    cache = tmp_path / "datasets"
    _cached_hub_dataset(cache, "local-org/calib", [{"text": t} for t in TEXTS + TEXTS[:3]], tmp_path)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(cache)}
    proc = cli("fp8", tiny, tmp_path / "out", "--calib", "local-org/calib", *BUILD, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = WARNING.replace("'dup.jsonl'", "'local-org/calib'")
    assert _warnings(proc.stderr) == [said], proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    quantizing = next(n for n, ln in enumerate(lines) if ln.startswith("✓ Quantizing"))
    assert lines.index(said) < quantizing, proc.stderr[-2000:]
    assert sum("Found the latest cached dataset" in ln for ln in lines) == 1, proc.stderr[-2000:]
    calib = json.loads((tmp_path / "out" / MANIFEST).read_text())["calibration"]
    assert (calib["kind"], calib["documents"], calib["repeated_documents"]) == ("hub", 15, 3), calib


def test_a_run_of_two_outputs_on_one_hub_dataset_reads_it_once(cli, tiny: Path, tmp_path: Path) -> None:
    """``quantkit run`` with two calibrating outputs on one hub dataset read it for each output (a request to the hub
    and the cache read again, one "Found the latest cached dataset" line each): the second takes the first's read,
    and each artifact still records the documents."""
    cache = tmp_path / "datasets"
    _cached_hub_dataset(cache, "local-org/calib", [{"text": t} for t in TEXTS + TEXTS[:3]], tmp_path)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(cache)}
    (tmp_path / "r.yaml").write_text(f"model:\n  source: {tiny}\noutput: rel\noutputs:\n  - method: fp8\n"
                                     "  - method: int8\n    weights: rtn\ncalibration:\n  dataset: local-org/calib\n"
                                     "  samples: 2\n  seq_len: 64\n")
    proc = cli("run", "r.yaml", "--no-eval", "--no-smoke", "--json", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sum("Found the latest cached dataset" in ln for ln in proc.stderr.splitlines()) == 1, proc.stderr[-2000:]
    outputs = json.loads(proc.stdout)["outputs"]
    assert [o["status"] for o in outputs] == ["built", "built"], outputs
    for o in outputs:
        calib = json.loads((tmp_path / o["path"] / MANIFEST).read_text())["calibration"]
        assert (calib["kind"], calib["documents"], calib["repeated_documents"]) == ("hub", 15, 3), calib
