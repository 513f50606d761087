"""Which seal covers a path (quantkit.integrity.artifact_of), and which folders claim to be artifacts
(quantkit.integrity.holds_manifest, shared by verify, smoke and eval's report check).

The seal of a path is the outermost manifest that really covers it: its folder's own, or one above that lists the
entry of its folder the path is or is in. So a ``quantkit.json`` above an artifact that lists nothing on the way
(a stray ``~/quantkit.json``: not a manifest at all, another tool's, another folder's manifest) is passed over,
where the outermost rule of 9c48fc9 took it for the seal of everything under it and refused every good artifact
below; while a manifest nested in a folder an artifact lists stays one of that artifact's files, never the seal
(tests/test_verify_nested.py has the CLI's side of it).

Python API only, on small artifacts sealed by quantkit's own writer: no model, no process. The FIFOs here are
never opened, by the test or by quantkit."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest

from quantkit import artifact, integrity, outputs, seal
from quantkit.errors import IntegrityError, UnsafeOutputError, UsageError
from quantkit.manifest import MANIFEST, FileInfo, Manifest, SourceInfo, read_manifest, write_manifest

pytestmark = pytest.mark.unit

FILES = {"config.json": b"{}", "model.safetensors": b"weights", "gptq/model.safetensors": b"legacy copy"}


def make(final: Path, files: dict[str, bytes] = FILES) -> Path:
    """A sealed artifact of ``files`` (relative name -> bytes), written by quantkit's own writer."""
    with artifact.ArtifactWriter(final) as w:
        for rel, data in files.items():
            (w.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (w.path / rel).write_bytes(data)
        w.commit(Manifest(kind="test", method="test", source=SourceInfo(id="src", path="/src", config_sha256="0" * 64)))
    return final


def stray(home: Path, kind: str, tmp_path: Path) -> None:
    """A ``quantkit.json`` in ``home`` that is the seal of nothing below it."""
    if kind == "text":
        (home / MANIFEST).write_text("my notes, not a manifest\n")
    elif kind == "another tool's":
        (home / MANIFEST).write_text('{"theme": "dark", "files": ["art"]}\n')
    else:  # a real manifest, of another folder (a copy kept in home), listing none of home's entries
        shutil.copy(make(tmp_path / "elsewhere", {"weights.bin": b"other"}) / MANIFEST, home / MANIFEST)


def sums(release: Path) -> None:
    """A release's SHA256SUMS over every file of it, as ``quantkit run``'s bundle writes it last."""
    found = sorted((p.relative_to(release).as_posix(), d) for p, d in seal.hash_many(integrity.release_files(release)))
    (release / integrity.SUMS).write_text("".join(f"{d}  {rel}\n" for rel, d in found))


@pytest.mark.parametrize("kind", ["text", "another tool's", "another folder's manifest"])
def test_a_stray_quantkit_json_above_an_artifact_is_no_seal_of_it(tmp_path: Path, kind: str) -> None:
    """``~/quantkit.json`` above ``~/art``: verify of the artifact, a file of it and its legacy copy's folder took
    it for their seal (not a manifest: exit 1 on a good artifact; another folder's: every file not listed). Each is
    checked against the artifact's own manifest, which still names a change."""
    home = tmp_path / "home"
    art = make(home / "art")
    stray(home, kind, tmp_path)
    for path, checked in ((art, 3), (art / "model.safetensors", 1), (art / "gptq", 1), (art / MANIFEST, 3)):
        assert integrity.artifact_of(path) == art
        [res] = integrity.verify_tree(path)
        assert (res.root, res.ok, res.checked) == (art, True, checked), (path, res)
    (art / "model.safetensors").write_bytes(b"changed")
    [res] = integrity.verify_tree(art)
    assert (res.root, res.ok, res.changed) == (art, False, ["model.safetensors"]), res


@pytest.mark.parametrize("kind", ["text", "another tool's", "another folder's manifest"])
def test_a_release_below_a_stray_quantkit_json(tmp_path: Path, kind: str) -> None:
    """A release folder (``quantkit run``'s: one artifact each, sealed by SHA256SUMS, no manifest of its own) below
    a stray ``quantkit.json``: ``verify RELEASE`` checks each artifact and the sums, ``verify RELEASE/ART`` the
    artifact against its own manifest (the release's sums are no manifest: ``verify RELEASE`` checks them)."""
    home = tmp_path / "home"
    release = home / "release"
    for name in ("a", "b"):
        make(release / name)
    sums(release)
    stray(home, kind, tmp_path)
    res = integrity.verify_tree(release)
    assert [(r.root, r.seal, r.ok) for r in res] == [(release / "a", MANIFEST, True), (release / "b", MANIFEST, True),
                                                     (release, integrity.SUMS, True)], res
    [res] = integrity.verify_tree(release / "a")
    assert (res.root, res.seal, res.ok, res.checked) == (release / "a", MANIFEST, True, 3), res


def test_a_manifest_forged_where_the_artifact_lists_files_is_still_no_seal(tmp_path: Path) -> None:
    """The artifact lists files under ``notes/``, so it seals everything there: a file added there with a forged
    ``notes/quantkit.json`` listing it (and a changed one) is checked against the artifact, under a stray
    ``quantkit.json`` above too, never against the forged one, which lists the file."""
    home = tmp_path / "home"
    art = make(home / "art", {**FILES, f"notes/{MANIFEST}": b"{}", "notes/notes.txt": b"kept\n"})
    stray(home, "text", tmp_path)
    (art / "notes" / "notes.txt").write_text("changed\n")
    (art / "notes" / "new.txt").write_text("added\n")
    listed = {p.name: FileInfo(sha256=hashlib.sha256(p.read_bytes()).hexdigest(), size=p.stat().st_size)
              for p in (art / "notes" / "notes.txt", art / "notes" / "new.txt")}
    write_manifest(art / "notes", read_manifest(art).model_copy(update={"files": listed}))
    for path in (art / "notes", art / "notes" / "new.txt", art / "notes" / "notes.txt"):
        assert integrity.artifact_of(path) == art
        [res] = integrity.verify_tree(path)
        assert res.root == art and not res.ok, (path, res)
    [res] = integrity.verify_tree(art / "notes")
    assert (res.changed, res.extra) == (["notes/notes.txt", f"notes/{MANIFEST}"], ["notes/new.txt"]), res


def test_a_folder_the_artifact_lists_nothing_in_is_sealed_by_its_own_manifest(tmp_path: Path) -> None:
    """An artifact put inside another one's folder, which lists nothing under it: no seal of the outer one covers
    it (that one names its files as not listed), so it is checked against its own manifest."""
    art = make(tmp_path / "art")
    inner = make(tmp_path / "inner", {"config.json": b'{"inner": 1}'})
    shutil.move(inner, art / "inner")
    [res] = integrity.verify_tree(art / "inner")
    assert (res.root, res.ok, res.checked) == (art / "inner", True, 1), res
    [res] = integrity.verify_tree(art)
    assert (res.root, res.ok, res.extra) == (art, False, ["inner/config.json", f"inner/{MANIFEST}"]), res


def test_a_quantkit_json_above_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    """A FIFO at ``~/quantkit.json`` cannot be read (never opened), so it cannot be ruled out as the seal: verify
    below it names it in one line, exit 1, rather than passing over what might list the path."""
    home = tmp_path / "home"
    art = make(home / "art")
    os.mkfifo(home / MANIFEST)
    with pytest.raises(IntegrityError, match=f"^{re.escape(str(home / MANIFEST))} is a FIFO, not a file"):
        integrity.verify_tree(art)


@pytest.mark.parametrize("kind", ["fifo", "device", "file"])
def test_a_report_is_never_written_into_what_verify_takes_for_an_artifact(tmp_path: Path, kind: str) -> None:
    """``eval --report-dir`` (quantkit.outputs.check_outside_seals) tested a manifest with ``is_file()``, so an
    artifact whose quantkit.json is a FIFO or a device took a report into it and a folder inside it, while verify
    and smoke take it for the artifact it claims to be (and refuse its manifest in one line). The same test says
    what an artifact is for both: refused, exit 2, the manifest never opened."""
    art = make(tmp_path / "art")
    (art / MANIFEST).unlink()
    if kind == "fifo":
        os.mkfifo(art / MANIFEST)
    elif kind == "device":
        os.symlink("/dev/null", art / MANIFEST)
    else:
        (art / MANIFEST).write_text("{}")
    for folder, where in ((art, "is another quantkit artifact"), (art / "gptq", "lies inside the quantkit artifact")):
        said = f"report folder {folder} {where}"
        with pytest.raises(UnsafeOutputError, match=f"^{re.escape(said)}"):
            outputs.check_outside_seals(folder, ["report.md"], [tmp_path / "evaluated"])
    assert integrity.artifact_of(art) == art and integrity.artifact_of(art / "config.json") == art
    assert integrity.holds_manifest(art)
    (art / MANIFEST).unlink()
    (art / MANIFEST).mkdir()  # a folder of that name claims nothing, for either
    assert not integrity.holds_manifest(art) and integrity.artifact_of(art) is None
    outputs.check_outside_seals(art / "gptq", ["report.md"], [tmp_path / "evaluated"])


@pytest.mark.parametrize("kind", ["text", "another tool's", "another folder's manifest"])
def test_a_file_below_a_stray_quantkit_json_is_no_artifacts(tmp_path: Path, kind: str) -> None:
    """A file of a folder without a manifest below a stray ``~/quantkit.json`` (a GGUF file, a checkpoint's weights)
    belonged to the folder of the stray one, which ``eval``, ``inspect`` and ``smoke`` then read as its artifact's
    manifest: it is no artifact's."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "model.gguf").write_bytes(b"GGUF")
    stray(home, kind, tmp_path)
    assert integrity.artifact_of(home / "models" / "model.gguf") is None
    assert integrity.artifact_of(home / "models") is None


def test_a_file_in_a_folder_the_artifact_lists_nothing_in_is_no_artifacts(tmp_path: Path) -> None:
    """A file beside an artifact's manifest that it does not list is the artifact's (named as not listed); one in a
    folder of the user's the manifest lists nothing in is as that folder is, no artifact's: verify of it says so
    (exit 2), and verify of the artifact names it as not listed (exit 1)."""
    art = make(tmp_path / "art")
    (art / "added.txt").write_text("added\n")
    (art / "data").mkdir()
    (art / "data" / "x.txt").write_text("mine\n")
    [res] = integrity.verify_tree(art / "added.txt")
    assert (res.root, res.ok, res.extra) == (art, False, ["added.txt"]), res
    for path in (art / "data", art / "data" / "x.txt"):
        assert integrity.artifact_of(path) is None
        with pytest.raises(UsageError):
            integrity.verify_tree(path)
    [res] = integrity.verify_tree(art)
    assert (res.ok, res.extra) == (False, ["added.txt", "data/x.txt"]), res
