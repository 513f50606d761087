"""``verify`` of a path inside an artifact whose subfolder holds a ``quantkit.json`` of its own (a user's nested
folder): the artifact's manifest seals that file like any other (since 6875aa6), so the path is checked against the
artifact's seal, never against the nested file taken for a manifest (quantkit.integrity.artifact_of)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import quantkit
from quantkit import artifact
from quantkit.manifest import MANIFEST, FileInfo, read_manifest, write_manifest

pytestmark = pytest.mark.cli

NOTES = "notes"  # the user's folder inside the artifact, holding a copy of a manifest


def nested(tiny_rtn: Path, folder: Path) -> Path:
    """``quantkit rtn``'s artifact of the reference model sealed again by quantkit's writer with ``notes/`` in it:
    the manifest of the artifact (a copy a user kept) and a note, both sealed as the artifact's files."""
    with artifact.ArtifactWriter(folder) as w:
        for f in tiny_rtn.iterdir():
            if f.name != MANIFEST:
                shutil.copy(f, w.path / f.name)
        (w.path / NOTES).mkdir()
        shutil.copy(tiny_rtn / MANIFEST, w.path / NOTES / MANIFEST)
        (w.path / NOTES / "notes.txt").write_text("kept with the copy of its manifest\n")
        w.commit(read_manifest(tiny_rtn))
    assert {f"{NOTES}/{MANIFEST}", f"{NOTES}/notes.txt"} <= set(read_manifest(folder).files)
    return folder


def verify(path: Path) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    """``quantkit verify PATH --json`` as a real process, and what it reported."""
    proc = quantkit("verify", path, "--json", timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc, json.loads(proc.stdout)


def test_verify_a_nested_quantkit_json_checks_it_against_the_artifact(tiny_rtn: Path, tmp_path: Path) -> None:
    """``verify ART/notes/quantkit.json`` (or ``verify ART/notes``) took the nested file for the artifact's manifest
    and checked the folder against it: every file it lists was missing there, exit 1, for an intact artifact. It is
    one of ART's files: checked against ART's seal, its hash state reported, and ``verify ART`` stays right."""
    art = nested(tiny_rtn, tmp_path / "art")
    count = len(read_manifest(art).files)
    for path, checked in ((art / NOTES / MANIFEST, 1), (art / NOTES, 2), (art, count)):
        proc, [res] = verify(path)
        assert proc.returncode == 0, (path, proc.stdout, proc.stderr[-2000:])
        assert (res["path"], res["seal"], res["checked"], res["ok"]) == (str(art), MANIFEST, checked, True), res
    (art / NOTES / MANIFEST).write_text("{}")
    for path in (art / NOTES / MANIFEST, art / NOTES, art):
        proc, [res] = verify(path)
        assert proc.returncode == 1, (path, proc.stdout)
        assert (res["path"], res["changed"], res["missing"], res["extra"]) == \
            (str(art), [f"{NOTES}/{MANIFEST}"], [], []), res


def test_a_manifest_forged_in_a_subfolder_does_not_vouch_for_it(tiny_rtn: Path, tmp_path: Path) -> None:
    """A subfolder's files changed, and a quantkit.json put beside them listing their new sha256, passed
    ``verify ART/notes``: the forged file was the seal it was checked against. ART's seal covers the subfolder,
    so both files are named as changed, exit 1."""
    art = nested(tiny_rtn, tmp_path / "art")
    note = art / NOTES / "notes.txt"
    note.write_text("changed after sealing\n")
    listed = FileInfo(sha256=hashlib.sha256(note.read_bytes()).hexdigest(), size=note.stat().st_size)
    write_manifest(art / NOTES, read_manifest(art).model_copy(update={"files": {"notes.txt": listed}}))
    proc, [res] = verify(art / NOTES)
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-2000:])
    assert (res["path"], res["changed"]) == (str(art), [f"{NOTES}/notes.txt", f"{NOTES}/{MANIFEST}"]), res

