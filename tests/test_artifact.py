"""Atomic artifact folders, --force, the lock, the free-space check, and the manifest seal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit import artifact
from quantkit.errors import DiskSpaceError, LockedError, OutputExistsError


def make(final: Path, content: bytes = b"weights", force: bool = False) -> dict:
    with artifact.ArtifactWriter(final, force=force) as w:
        (w.path / "model.safetensors").write_bytes(content)
        (w.path / "sub").mkdir()
        (w.path / "sub" / "tokenizer.json").write_text("{}")
        return w.commit({"format": "test"})


def test_commit_renames_into_place_with_manifest(tmp_path: Path) -> None:
    out = tmp_path / "art"
    m = make(out)
    assert sorted(m["files"]) == ["model.safetensors", "sub/tokenizer.json"]
    assert m["files"]["model.safetensors"]["sha256"] == artifact.sha256_file(out / "model.safetensors")
    assert json.loads((out / "quantkit.json").read_text())["format"] == "test"
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no temp folder or lock left behind


def test_failure_leaves_nothing_at_the_output(tmp_path: Path) -> None:
    out = tmp_path / "art"
    with pytest.raises(RuntimeError):
        with artifact.ArtifactWriter(out) as w:
            (w.path / "half.safetensors").write_bytes(b"x" * 100)
            raise RuntimeError("backend crashed")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force_and_is_replaced_only_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "art"
    make(out, b"v1")
    with pytest.raises(OutputExistsError, match="--force"):
        make(out, b"v2")
    with pytest.raises(RuntimeError):
        with artifact.ArtifactWriter(out, force=True) as w:
            (w.path / "model.safetensors").write_bytes(b"v2-partial")
            raise RuntimeError("crash mid-way")
    assert (out / "model.safetensors").read_bytes() == b"v1"  # the old artifact survives a failed --force
    make(out, b"v2", force=True)
    assert (out / "model.safetensors").read_bytes() == b"v2"
    assert artifact.verify(out).ok


def test_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "art"
    # A real second process holds the lock.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from quantkit import artifact\n"
        f"with artifact.output_lock(Path({str(out)!r})):\n"
        "    print('locked', flush=True); time.sleep(30)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError, match=f"pid {holder.pid}"):
            make(out)
    finally:
        holder.kill()
        holder.wait()
    make(out)  # the kernel released the lock when the holder died


def test_free_space_is_checked_before_writing(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(DiskSpaceError, match="not enough free space"):
        with artifact.ArtifactWriter(tmp_path / "art", expected_bytes=free * 2):
            pass
    assert list(tmp_path.iterdir()) == []


def test_verify_catches_tampering_missing_and_extra_files(tmp_path: Path) -> None:
    out = tmp_path / "art"
    make(out, b"A" * 1000)
    data = bytearray((out / "model.safetensors").read_bytes())
    data[10] ^= 1  # one flipped bit
    (out / "model.safetensors").write_bytes(bytes(data))
    (out / "sub" / "tokenizer.json").unlink()
    (out / "evil.py").write_text("print('hi')")
    res = artifact.verify(out)
    assert not res.ok
    assert res.changed == ["model.safetensors"] and res.missing == ["sub/tokenizer.json"] and res.extra == ["evil.py"]


def test_inspect_and_verify_cli_catch_a_tampered_file(tmp_path: Path, cli) -> None:
    out = tmp_path / "art"
    make(out, b"B" * 1000)
    ok = cli("verify", out, "--json", check=True)
    assert json.loads(ok.stdout)[0]["ok"] is True
    (out / "model.safetensors").write_bytes(b"C" * 1000)
    bad = cli("inspect", out)
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout and "model.safetensors" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert cli("verify", out).returncode == 1


def test_update_manifest_rehashes_new_files(tmp_path: Path) -> None:
    out = tmp_path / "art"
    make(out)
    (out / "report.md").write_text("# report")
    m = artifact.update_manifest(out, evaluation={"ppl": 1.0})
    assert m["evaluation"] == {"ppl": 1.0} and "report.md" in m["files"]
    assert artifact.verify(out).ok
