"""Files quantkit must take for what they are: a FIFO, a socket or a device where it reads a user's file (refused in
one line, never waited on), and a ``quantkit.json`` in a subfolder of an artifact (one of its files, sealed).

Every ``quantkit`` process runs under a timeout: a reader that blocks on a FIFO again fails here, naming the
command, instead of hanging the suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import TINY, quantkit
from quantkit import artifact, integrity
from quantkit.manifest import MANIFEST, Manifest, SourceInfo

pytestmark = pytest.mark.cli

TIMEOUT = 60  # seconds: each command below ends in a few; one waiting on a FIFO would wait for ever


def run(*args: str | Path) -> subprocess.CompletedProcess:
    """``quantkit ARGS`` as a real process, failing the test when it is still running after :data:`TIMEOUT`."""
    try:
        return quantkit(*args, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"quantkit {' '.join(map(str, args))} was still running after {TIMEOUT} s: it waited on a FIFO")


def source_with(folder: Path, name: str, special: str) -> Path:
    """The reference model as a folder of links to its files, ``name`` being ``special`` instead: ``fifo``, a named
    pipe no one writes, or ``zero``, a link to /dev/zero (a device that never ends)."""
    folder.mkdir()
    for f in TINY.iterdir():
        if f.name != name:
            os.symlink(f, folder / f.name)
    if special == "fifo":
        os.mkfifo(folder / name)
    else:
        os.symlink("/dev/zero", folder / name)
    return folder


def one_line(proc: subprocess.CompletedProcess, rc: int, path: Path, what: str) -> None:
    """The command ended with ``rc`` on one error line naming ``path`` as ``what``, without a traceback."""
    assert proc.returncode == rc and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: {path} is {what}, not a file"), proc.stderr[-2000:]


@pytest.mark.parametrize(("name", "special", "what"), [
    ("config.json", "fifo", "a FIFO"),
    ("model.safetensors", "fifo", "a FIFO"),
    ("model.safetensors", "zero", "a device"),
    ("tokenizer_config.json", "fifo", "a FIFO"),  # not read by quantkit's checks: transformers' tokenizer load would
])
def test_a_special_file_in_the_source_is_refused_not_waited_on(tmp_path: Path, name: str, special: str,
                                                                what: str) -> None:
    """A source whose config.json or weight file was a FIFO hung the quantize verbs (``--dry-run`` included): each
    was opened and read, and a FIFO no one writes blocks for ever. A device, or a FIFO among the files a library
    reads later (tokenizer_config.json), is the same trap. Each is one line naming it, exit 2 (the source's fault,
    as a corrupt one is), and nothing is written."""
    src = source_with(tmp_path / "src", name, special)
    out = tmp_path / "out"
    one_line(run("rtn", src, out, "--dry-run"), 2, src / name, what)
    assert not out.exists()


def test_a_fifo_config_read_to_recognise_a_folder_is_refused(tmp_path: Path) -> None:
    """``doctor FOLDER`` recognises the folder by its config.json (quantkit.checkpoint.read_config, which every
    kind test reads): one that is a FIFO hung it. One line naming it, exit 1, as inspect says it."""
    src = source_with(tmp_path / "src", "config.json", "fifo")
    one_line(run("doctor", src), 1, src / "config.json", "a FIFO")


def make(final: Path, files: dict[str, bytes]) -> Manifest:
    """A sealed artifact of ``files`` (relative name -> bytes), written by quantkit's own writer."""
    with artifact.ArtifactWriter(final) as w:
        for rel, data in files.items():
            (w.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (w.path / rel).write_bytes(data)
        source = SourceInfo(id=str(TINY), path=str(TINY), config_sha256="0" * 64)
        return w.commit(Manifest(kind="test", method="test", source=source))


def test_a_fifo_manifest_is_refused_not_waited_on(tmp_path: Path) -> None:
    """An artifact whose quantkit.json was a FIFO hung ``eval`` and a quantize verb's ``--force`` over it: each read
    the manifest (quantkit.manifest.read_capped), which opened it and waited for a writer. ``eval``, ``verify`` and
    ``inspect`` say it in one line, exit 1; ``--force`` refuses the output as one quantkit did not write, exit 2."""
    art = tmp_path / "art"
    make(art, {"config.json": b"{}", "model.safetensors": b"weights"})
    (art / MANIFEST).unlink()
    os.mkfifo(art / MANIFEST)
    for verb in ("eval", "verify", "inspect"):
        one_line(run(verb, art), 1, art / MANIFEST, "a FIFO")
    proc = run("rtn", TINY, art, "--dry-run", "--force")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"its quantkit.json does not read ({art / MANIFEST} is a FIFO, not a file" in proc.stderr, proc.stderr


def test_a_fifo_at_a_report_name_in_an_artifact_is_not_waited_on(tmp_path: Path) -> None:
    """``--force`` over an artifact reads a file it does not list at a name quantkit writes after sealing (eval's
    report.md) to tell whether quantkit wrote it (quantkit.integrity.wrote): a FIFO there hung the quantize verbs.
    It is not quantkit's, so it is named and the output refused, exit 2, as any file of the user's is."""
    art = tmp_path / "art"
    make(art, {"config.json": b"{}", "model.safetensors": b"weights"})
    os.mkfifo(art / "report.md")
    proc = run("rtn", TINY, art, "--dry-run", "--force")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: output {art} holds files its {MANIFEST} does not list: report.md;"), \
        proc.stderr


@pytest.mark.unit
def test_a_quantkit_json_in_a_subfolder_is_sealed(tmp_path: Path) -> None:
    """Every file named quantkit.json was left out of an artifact's seal, so one in a subfolder was never hashed
    and verify could not see it change. Only the artifact's own manifest (at its top) is left out now."""
    art = tmp_path / "art"
    m = make(art, {"config.json": b"{}", "sub/quantkit.json": b'{"kind": "notes"}'})
    assert sorted(m.files) == ["config.json", "sub/quantkit.json"]
    assert integrity.verify(art).ok
    (art / "sub" / MANIFEST).write_bytes(b'{"kind": "other"}')
    res = integrity.verify_tree(art)
    assert [r.changed for r in res] == [["sub/quantkit.json"]], res


def test_verify_names_a_quantkit_json_added_to_a_subfolder(tiny_rtn: Path, tmp_path: Path) -> None:
    """A quantkit.json added to a subfolder of a real artifact (quantkit rtn of the reference model) after it was
    sealed passed ``quantkit verify``: any file of that name was taken for the artifact's manifest. It is named as
    not listed, exit 1; the artifact's own manifest still seals the rest."""
    art = tmp_path / "art"
    shutil.copytree(tiny_rtn, art)
    assert run("verify", art).returncode == 0
    (art / "extra").mkdir()
    shutil.copy(art / MANIFEST, art / "extra" / MANIFEST)
    proc = run("verify", art, "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    [res] = json.loads(proc.stdout)
    assert res["extra"] == ["extra/quantkit.json"] and not res["changed"] and not res["missing"], res


def test_a_recipe_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    """``quantkit run RECIPE`` read a recipe that was a named pipe with a plain open: the dry run waited for ever."""
    recipe = tmp_path / "recipe.yaml"
    os.mkfifo(recipe)
    one_line(run("run", recipe, "--dry-run"), 2, recipe, "a FIFO")

