"""Never destroy what the user has (issue 29): the source, inputs, folders and files quantkit did not write, and
recipes that would expand without bound. Each refusal goes through a real ``quantkit`` process and must leave every
file as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit import artifact, integrity
from quantkit.errors import OutputExistsError
from quantkit.manifest import MANIFEST, Manifest, SourceInfo, read_manifest

from conftest import ROOT, TINY, quantkit

pytestmark = pytest.mark.cli

SOURCE = SourceInfo(id="src", path="/nowhere", config_sha256="0" * 64)


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (links as their target), the whole state a refusal must leave alone."""
    found = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            found[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            found[rel] = "dir"
    return found


def fake_artifact(folder: Path) -> None:
    """A small folder quantkit wrote (through its own writer), to stand for an artifact without quantizing."""
    with artifact.ArtifactWriter(folder, force=True) as w:
        (w.path / "model.safetensors").write_bytes(b"old")
        w.commit(Manifest(kind="test", method="test", source=SOURCE))


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A user's folder: a copy of the reference model (as parent/src) beside files of their own."""
    (tmp_path / "parent").mkdir()
    shutil.copytree(TINY, tmp_path / "parent" / "src")
    (tmp_path / "parent" / "other.txt").write_text("mine")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine too")
    (tmp_path / "link").symlink_to("parent/src")
    return tmp_path


@pytest.mark.parametrize("output, relation", [
    ("parent/src", "is the source"), ("parent", "holds the source"), ("parent/src/q", "lies inside the source"),
    ("parent/../link", "is the source"), ("notes/../parent/src", "is the source")])
def test_an_output_over_the_source_is_refused_before_any_work(work: Path, output: str, relation: str) -> None:
    before = tree(work)
    proc = quantkit("rtn", "parent/src", output, "--force", cwd=work)
    assert proc.returncode == 2, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert relation in first and output in first and "parent/src" in first and "Traceback" not in proc.stderr
    assert tree(work) == before


def test_a_source_given_through_a_link_is_still_the_source(work: Path) -> None:
    before = tree(work)
    proc = quantkit("gguf", "link", "parent", "-t", "F16", "--force", cwd=work)
    assert proc.returncode == 2 and "holds the source model link" in proc.stderr
    assert tree(work) == before


def test_force_refuses_a_folder_quantkit_did_not_write(work: Path) -> None:
    before = tree(work)
    for argv, why in ((["rtn", "parent/src", "notes", "--force"], "notes exists and was not written by quantkit"),
                      (["rtn", "parent/src", "notes", "--force", "--dry-run"],
                       "notes exists and was not written by quantkit"),
                      (["rtn", "parent/src", "parent/other.txt", "--force"],
                       "parent/other.txt exists and is not a folder quantkit wrote")):
        proc = quantkit(*argv, cwd=work)
        assert proc.returncode == 2, proc.stderr
        assert why in proc.stderr and "remove it yourself, or choose another output" in proc.stderr, proc.stderr
    assert tree(work) == before


def test_an_input_inside_an_output_that_force_replaces_is_refused(work: Path) -> None:
    fake_artifact(work / "out")
    (work / "out" / "recipe.yaml").write_text("model:\n  source: parent/src\noutput: out\nquantize:\n  method: rtn\n")
    (work / "cal.txt").write_text("calibration text " * 200)
    before = tree(work)
    proc = quantkit("rtn", "--recipe", "out/recipe.yaml", "--force", cwd=work)
    assert proc.returncode == 2 and "holds the recipe out/recipe.yaml" in proc.stderr, proc.stderr
    proc = quantkit("gguf", "parent/src", "out", "--imatrix-file", "out/model.safetensors", "--force", cwd=work)
    assert proc.returncode == 2 and "holds the importance matrix" in proc.stderr, proc.stderr
    assert tree(work) == before


def test_run_refuses_before_building_anything(work: Path) -> None:
    """A multi-output release: one output folder is the user's, or the release folder holds a report.json that is
    not quantkit's: refused before the first output is built, so nothing changes (no half-done release)."""
    (work / "rel" / "rtn-w4g128").mkdir(parents=True)
    (work / "rel" / "rtn-w4g128" / "keep.txt").write_text("mine")
    (work / "recipe.yaml").write_text("model:\n  source: parent/src\noutput: rel\noutputs:\n  - method: rtn\n"
                                      "    bits: 8\n  - method: rtn\n")
    before = tree(work)
    proc = quantkit("run", "recipe.yaml", "--force", "--no-eval", "--no-smoke", cwd=work)
    assert proc.returncode == 2 and "rel/rtn-w4g128 exists and was not written by quantkit" in proc.stderr
    shutil.rmtree(work / "rel" / "rtn-w4g128")
    (work / "rel" / "report.json").write_text('{"my": "numbers"}')
    before = tree(work)
    proc = quantkit("run", "recipe.yaml", "--no-eval", "--no-smoke", cwd=work)
    assert proc.returncode == 2 and "rel/report.json exists and was not written by quantkit" in proc.stderr
    assert tree(work) == before


def test_eval_writes_no_report_into_the_baseline_nor_over_a_users_file(work: Path) -> None:
    (work / "reports").mkdir()
    (work / "reports" / "report.md").write_text("# my own notes\n")
    before = tree(work)
    proc = quantkit("eval", "parent/src", "--baseline", "link", "--report-dir", "parent/src/eval", cwd=work)
    assert proc.returncode == 2 and "lies inside the source model link" in proc.stderr, proc.stderr
    proc = quantkit("eval", "parent/src", "--baseline", "parent/src", "--report-dir", "reports", cwd=work)
    assert proc.returncode == 2 and "reports/report.md exists and was not written by quantkit" in proc.stderr
    assert tree(work) == before


def _sealed_release(folder: Path) -> None:
    """A release folder as ``quantkit run`` leaves it: an artifact inside, a folder of the user's, its SHA256SUMS."""
    fake_artifact(folder / "a")
    (folder / "notes").mkdir()
    sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(folder).as_posix()}\n"
                   for p in integrity.release_files(folder))
    (folder / integrity.SUMS).write_text(sums)


@pytest.mark.parametrize("report_dir, said", [
    ("other", "report folder other is another quantkit artifact"),
    ("other/sub", "report folder other/sub lies inside the quantkit artifact"),
    ("rel", "report folder rel is a release that does not hold every evaluated artifact"),
    ("rel/notes", "report folder rel/notes lies inside the release")])
def test_eval_writes_no_report_into_another_artifact_nor_a_release(work: Path, report_dir: str, said: str) -> None:
    """``eval --report-dir`` into another artifact or a release (or a folder inside one) wrote report.md and the
    plot there, and ``verify`` then found them not listed in its seal: refused before any scoring, exit 2."""
    fake_artifact(work / "other")
    _sealed_release(work / "rel")
    before = tree(work)
    proc = quantkit("eval", "parent/src", "--baseline", "parent/src", "--dataset", "heldout", "--max-tokens", "16",
                    "--report-dir", report_dir, cwd=work)
    assert proc.returncode == 2 and said in proc.stderr and "would break its seal" in proc.stderr, proc.stderr
    assert "--report-dir" in proc.stderr and "protocol:" not in proc.stderr and "Traceback" not in proc.stderr
    assert tree(work) == before
    assert all(r.ok for r in integrity.verify_tree(work / "rel")) and integrity.verify(work / "other").ok


def test_eval_tasks_writes_no_report_into_another_artifact(work: Path) -> None:
    """``eval --tasks``'s tasks.md follows the same rule as eval's report: never into another artifact's seal."""
    pytest.importorskip("lm_eval")
    fake_artifact(work / "other")
    before = tree(work)
    proc = quantkit("eval", "parent/src", "--baseline", "parent/src", "--tasks", "quantkit_lastword", "--limit", "2",
                    "--report-dir", "other", cwd=work)
    assert proc.returncode == 2 and "other is another quantkit artifact: writing tasks.md" in proc.stderr, proc.stderr
    assert tree(work) == before


BILLION_LAUGHS = "".join(f"{a}: &{a} [{', '.join([f'*{b}'] * 9)}]\n" for b, a in zip("abcdefgh", "bcdefghi"))
BILLION_LAUGHS = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + BILLION_LAUGHS


def test_billion_laughs_fails_fast_in_bounded_memory(tmp_path: Path) -> None:
    (tmp_path / "lol.yaml").write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 600
    from test_fuzz import limited_quantkit

    proc = limited_quantkit(["run", "lol.yaml", "--dry-run"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: lol.yaml: line 6 is refused: expands to more than 100,000 values (aliases count as what they "
        "stand for)"]


def test_force_replaces_an_empty_folder_and_an_artifact_only(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    fake_artifact(tmp_path / "empty")
    fake_artifact(tmp_path / "empty")  # an artifact is replaced in turn
    assert read_manifest(tmp_path / "empty").kind == "test"
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / MANIFEST).write_text("{not json")
    with pytest.raises(OutputExistsError, match="does not read"):
        artifact.check_replaceable(tmp_path / "broken")
    (tmp_path / "link").symlink_to("empty")
    with pytest.raises(OutputExistsError, match="not a folder quantkit wrote"):
        artifact.check_replaceable(tmp_path / "link")


def test_quantkits_own_bundle_files_are_recognised(tmp_path: Path) -> None:
    ours = {"report.md": "# quantkit evaluation\n\nBaseline ...\n",
            "SHA256SUMS": f"{'0' * 64}  a/model.safetensors\n{'f' * 64}  report.md\n",
            "report.json": json.dumps({"release": "rel", "ok": True, "outputs": []})}
    theirs = {"report.md": "# quantkit evaluation, my notes about it", "SHA256SUMS": "0000  a\n",
              "report.json": json.dumps([1, 2]), "size-vs-ppl.png": "\x89PNG\r\n\x1a\n made by hand"}
    for files, expected in ((ours, True), (theirs, False)):
        for name, text in files.items():
            (tmp_path / name).write_text(text)
            assert integrity.wrote(tmp_path / name) is expected, name


def test_force_refuses_an_artifact_holding_the_users_files(work: Path) -> None:
    """--force replaced a quantkit artifact the user had put notes and data into, and removed them (exit 0): the
    files its manifest does not list are named, nothing is removed (exit 2, --dry-run too). A folder holding only
    a copied quantkit.json beside the user's thesis is refused the same way."""
    fake_artifact(work / "q2x")
    (work / "q2x" / "NOTES.md").write_text("notes")
    (work / "q2x" / "mydata").mkdir()
    (work / "q2x" / "mydata" / "important.csv").write_text("1")
    (work / "thesis").mkdir()
    shutil.copy(work / "q2x" / MANIFEST, work / "thesis")
    (work / "thesis" / "thesis.tex").write_text("\\documentclass{article}")
    before = tree(work)
    for argv, shown in ((["q2x", "--force"], "NOTES.md, mydata/"), (["q2x", "--force", "--dry-run"], "NOTES.md, mydata/"),
                        (["thesis", "--force"], "thesis.tex")):
        proc = quantkit("rtn", "parent/src", *argv, cwd=work)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.splitlines() == [
            f"error: output {argv[0]} holds files its quantkit.json does not list: {shown}; --force would remove "
            "them with the artifact", f"  hint: move them out of {argv[0]}, or choose another output"]
    assert tree(work) == before


def test_force_replaces_what_quantkit_left_unsealed_in_an_artifact(tmp_path: Path) -> None:
    """What quantkit writes into an artifact after sealing it (run's model card, eval's report, a one-output run's
    bundle and logs) is sealed once written; a run stopped before that leaves it unlisted, and --force still
    replaces such an artifact. The same names holding the user's own content are the user's."""
    out = tmp_path / "one"
    fake_artifact(out)
    (out / "README.md").write_text("---\ntags:\n- quantkit\n---\n\n# src - one\n\nQuantized from `src` with quantkit "
                                   "0.1.0 (rtn, compressed-tensors).\n")
    (out / "report.md").write_text("# quantkit evaluation\n\nBaseline ...\n")
    (out / "logs" / "one.tune").mkdir(parents=True)
    (out / "logs" / "one.smoke-transformers.log").write_text("server log")
    (out / "logs" / "one.tune" / "marlin.request.json").write_text("{}")
    (out / ".quantkit.json.tmp-4242").write_text("{")
    artifact.check_replaceable(out)
    (out / "report.md").write_text("# my own notes on the evaluation\n")
    (out / "logs" / "mine.csv").write_text("1,2")
    with pytest.raises(OutputExistsError, match=r"does not list: logs/mine\.csv, report\.md;"):
        artifact.check_replaceable(out)
    fake_artifact(tmp_path / "clean")
    fake_artifact(tmp_path / "clean")  # an artifact holding only what it lists is replaced, as before


SWAP = """
import os, shutil, signal, sys
from pathlib import Path

import typer

from quantkit import artifact
from quantkit.cli.common import handle_errors
from quantkit.manifest import Manifest, SourceInfo

final, when = Path(sys.argv[1]), sys.argv[2]
SOURCE = SourceInfo(id="src", path="/nowhere", config_sha256="0" * 64)


def write(content):
    with artifact.ArtifactWriter(final, force=True) as w:
        (w.path / "model.safetensors").write_bytes(content)
        if when == "twice" and content == b"new":
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, while the producer writes
        w.commit(Manifest(kind="test", method="test", source=SOURCE))


write(b"old")
real_replace, real_rmtree = os.replace, shutil.rmtree


def replace(src, dst):
    real_replace(src, dst)
    if when == "between" and ".old-" in str(dst):
        os.kill(os.getpid(), signal.SIGINT)  # the old artifact renamed away, the new one not yet in


def rmtree(path, *args, **kwargs):
    if (when == "removing" and ".old-" in str(path)) or (when == "twice" and ".partial-" in str(path)):
        os.kill(os.getpid(), signal.SIGINT)
    real_rmtree(path, *args, **kwargs)


os.replace, shutil.rmtree = replace, rmtree
try:
    handle_errors(lambda: write(b"new"))()
except typer.Exit as e:
    sys.exit(e.exit_code)
"""


@pytest.mark.parametrize("when", ["between", "removing"])
def test_a_stop_during_the_force_swap_leaves_one_whole_artifact(tmp_path: Path, when: str) -> None:
    """Ctrl-C between the swap's two renames lost both artifacts (the new one deleted, the old one hidden as
    .f1.old-PID); during the old one's removal it published the new one yet said the run was interrupted and left a
    hidden full copy. The swap and the removal now finish once begun, and the message says the new artifact is in
    place."""
    final = tmp_path / "f1"
    proc = subprocess.run([sys.executable, "-c", SWAP, str(final), when], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"interrupted (stopped by SIGINT as {final} was put in place: it holds the new "
                                   "artifact, complete and sealed; the old artifact was removed): temporary files "
                                   "were removed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f1"]
    assert (final / "model.safetensors").read_bytes() == b"new" and integrity.verify(final).ok


def test_a_second_stop_during_cleanup_still_removes_the_temporary_folder(tmp_path: Path) -> None:
    """A second Ctrl-C that landed in the cleanup's rmtree left .f1.partial-PID behind while the message said the
    temporary files were removed."""
    final = tmp_path / "f1"
    proc = subprocess.run([sys.executable, "-c", SWAP, str(final), "twice"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "interrupted (stopped by SIGINT): temporary files were removed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f1"]
    assert (final / "model.safetensors").read_bytes() == b"old"


@pytest.mark.parametrize("output, said", [
    ("afile/sub", "output afile/sub cannot be created: afile is not a folder"),
    ("/proc/qk-out", "output /proc/qk-out cannot be created: nothing can be written in /proc"),
    ("/sys/qk-out", "output /sys/qk-out cannot be created: nothing can be written in /sys")])
def test_an_output_that_cannot_be_created_is_refused_before_any_work(work: Path, output: str, said: str) -> None:
    """A file on the output's path, or a folder that takes no new entries, gave output_lock's FileExistsError,
    FileNotFoundError or PermissionError as a traceback (exit 1)."""
    (work / "afile").write_text("mine")
    before = tree(work)
    for extra in ([], ["--dry-run"]):
        proc = quantkit("rtn", "parent/src", output, *extra, cwd=work)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.splitlines()[0].startswith(f"error: {said}"), proc.stderr
    assert tree(work) == before
