"""Atomic artifact folders, --force, the lock, the free-space check, and the manifest seal."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import token_gguf
from quantkit import artifact, integrity
from quantkit.errors import DiskSpaceError, IntegrityError, LockedError, OutputExistsError, UsageError
from quantkit.locks import output_lock
from quantkit.manifest import MANIFEST, SCHEMA_VERSION, Manifest, SourceInfo, read_manifest, size_bytes
from quantkit.seal import sha256_file

pytestmark = pytest.mark.unit


ROOT = Path(__file__).resolve().parents[1]
SOURCE = SourceInfo(id="models/quantkit-tiny", path=str(ROOT / "models" / "quantkit-tiny"),
                             made_in=str(ROOT), config_sha256="0" * 64)


def make(final: Path, content: bytes = b"weights", force: bool = False) -> Manifest:
    with artifact.ArtifactWriter(final, force=force) as w:
        (w.path / "config.json").write_text("{}")
        (w.path / "model.safetensors").write_bytes(content)
        (w.path / "sub").mkdir()
        (w.path / "sub" / "tokenizer.json").write_text("{}")
        return w.commit(Manifest(kind="test", method="test", source=SOURCE))


def test_commit_renames_into_place_with_manifest(tmp_path: Path) -> None:
    out = tmp_path / "art"
    m = make(out)
    assert sorted(m.files) == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    assert m.files["model.safetensors"].sha256 == sha256_file(out / "model.safetensors")
    on_disk = json.loads((out / "quantkit.json").read_text())
    assert on_disk["kind"] == "test" and on_disk["schema_version"] == SCHEMA_VERSION
    assert read_manifest(out) == m
    assert m.timings["hash_and_sync"] >= 0  # quantkit's own cost after the producer is accounted for
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
    assert integrity.verify(out).ok


def test_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "art"
    # A real second process holds the lock.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from quantkit.locks import output_lock\n"
        f"with output_lock(Path({str(out)!r})):\n"
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
    res = integrity.verify(out)
    assert not res.ok
    assert res.changed == ["model.safetensors"] and res.missing == ["sub/tokenizer.json"] and res.extra == ["evil.py"]


@pytest.mark.cli
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


def _release(root: Path) -> Path:
    """A release folder as ``quantkit run`` leaves it: two artifacts, the reports, and SHA256SUMS (sha256sum's
    format) over every file, written last."""
    make(root / "rtn")
    make(root / "gguf", b"gguf weights")
    (root / "report.md").write_text("# report")
    (root / "report.json").write_text("{}")
    lines = [f"{sha256_file(p)}  {p.relative_to(root).as_posix()}" for p in integrity.release_files(root)]
    (root / integrity.SUMS).write_text("\n".join(lines) + "\n")
    return root


def test_verify_checks_a_release_folder_against_its_sha256sums(tmp_path: Path) -> None:
    """A release's report files lie in no artifact: its SHA256SUMS is their seal, checked after each artifact."""
    rel = _release(tmp_path / "rel")
    ok = integrity.verify_tree(rel)
    assert [(r.root.name, r.seal, r.ok) for r in ok] == [("gguf", MANIFEST, True),
                                                         ("rtn", MANIFEST, True), ("rel", integrity.SUMS, True)]
    assert ok[-1].checked == len(integrity.release_files(rel)) == 10
    (rel / "report.md").write_text("# edited")
    (rel / "notes.txt").write_text("mine")
    bad = integrity.verify_tree(rel)[-1]
    assert not bad.ok and bad.changed == ["report.md"] and bad.extra == ["notes.txt"] and bad.missing == []
    (rel / "report.json").unlink()
    assert integrity.verify_tree(rel)[-1].missing == ["report.json"]
    (rel / integrity.SUMS).unlink()  # the run writes it last: a release without one did not finish
    unsealed = integrity.verify_tree(rel)[-1]
    assert not unsealed.ok and not unsealed.sealed and unsealed.to_json()["sealed"] is False
    (rel / integrity.SUMS).write_text(f"{'0' * 64}  ../outside\n")
    with pytest.raises(IntegrityError, match="line 1"):
        integrity.verify_tree(rel)


def test_verify_a_file_against_the_manifest_of_its_folder(tmp_path: Path) -> None:
    out = tmp_path / "art"
    make(out, b"W" * 100)
    res = integrity.verify_tree(out / "model.safetensors")
    assert [(r.root, r.checked, r.ok) for r in res] == [(out, 1, True)]
    assert integrity.verify_tree(out / "sub" / "tokenizer.json")[0].ok
    (out / "model.safetensors").write_bytes(b"V" * 100)
    assert integrity.verify_tree(out / "model.safetensors")[0].changed == ["model.safetensors"]
    (out / "evil.py").write_text("print('hi')")
    assert integrity.verify_tree(out / "evil.py")[0].extra == ["evil.py"]
    (tmp_path / "lone.gguf").write_bytes(b"GGUF")
    with pytest.raises(UsageError, match="no folder with a quantkit.json"):
        integrity.verify_tree(tmp_path / "lone.gguf")


@pytest.mark.cli
def test_verify_cli_on_a_release_and_on_a_file(tmp_path: Path, cli) -> None:
    rel = _release(tmp_path / "rel")
    shown = json.loads(cli("verify", rel, "--json", check=True).stdout)
    assert [(r["seal"], r["ok"]) for r in shown] == [("quantkit.json", True)] * 2 + [("SHA256SUMS", True)]
    assert cli("verify", rel / "gguf" / "model.safetensors", check=True).stdout.startswith("ok ")
    (rel / "report.md").write_text("# edited")
    proc = cli("verify", rel)
    assert proc.returncode == 1 and "report.md" in proc.stdout and "SHA256SUMS" in proc.stderr
    (rel / integrity.SUMS).unlink()
    proc = cli("verify", rel)
    assert proc.returncode == 1 and "NOT SEALED" in proc.stdout and "Traceback" not in proc.stderr


def _seal_release(rel: Path, report: dict) -> None:
    """``quantkit run``'s last two steps: report.json with its verdict, then SHA256SUMS over every file."""
    (rel / integrity.REPORT_JSON).write_text(json.dumps({"release": str(rel), "outputs": [], **report}))
    lines = [f"{sha256_file(p)}  {p.relative_to(rel).as_posix()}" for p in integrity.release_files(rel)]
    (rel / integrity.SUMS).write_text("\n".join(lines) + "\n")


@pytest.mark.cli
def test_publish_checks_a_release_as_verify_does_and_refuses_a_failed_one(tmp_path: Path, cli) -> None:
    """publish checked each artifact alone: a release without its SHA256SUMS (a run cut short), with a changed
    report, or whose gates failed passed every check and would have uploaded. Each is refused in one line before
    the hub or the token is asked for (offline, no token: a release that passes stops at the token check)."""
    no_token = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN_PATH": str(tmp_path / "hf" / "t"),
                "HF_TOKEN": "", "HUGGING_FACE_HUB_TOKEN": ""}
    rel = tmp_path / "rel"
    make(rel / "rtn")
    make(rel / "gguf", b"gguf weights")
    (rel / "report.md").write_text("# quantkit evaluation\n")

    def publish(code: int, said: str) -> None:
        proc = cli("publish", rel, "--repo", "me/test", env=no_token, timeout=120)
        assert proc.returncode == code and said in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 2, proc.stderr

    _seal_release(rel, {"ok": False, "failed_gates": ["rtn: max_kld = 0.5 (limit 0.1)"]})
    publish(3, "failed verification gates: rtn: max_kld = 0.5 (limit 0.1)")
    _seal_release(rel, {"ok": False, "failed_gates": []})  # a failed output or smoke test, no gate
    publish(1, "did not pass (report.json says ok: false")
    _seal_release(rel, {"ok": True, "failed_gates": []})
    publish(2, "hf auth login")  # every check passed: only the token is missing
    (rel / "report.md").write_text("# quantkit evaluation\nedited\n")
    publish(1, "differ from its SHA256SUMS (changed ['report.md'])")
    (rel / integrity.SUMS).unlink()
    publish(1, "no SHA256SUMS")


def small_gguf(path: Path) -> Path:
    """A Q8_0-typed GGUF file with two tokens: what inspect and doctor read."""
    return token_gguf(path, ["a", "b"], file_type=7)  # MOSTLY_Q8_0


def gguf_artifact(final: Path) -> Path:
    with artifact.ArtifactWriter(final) as w:
        small_gguf(w.path / "m-Q8_0.gguf")
        w.commit(Manifest(kind="gguf", method="gguf", source=SOURCE))
    return final


@pytest.mark.cli
def test_inspect_a_gguf_file_inside_an_artifact_and_one_that_is_not_gguf(tmp_path: Path, cli) -> None:
    """A .gguf beside its quantkit.json read as 'manifest: none' with no hash checked; random bytes named .gguf
    printed a table row and exited 0 (doctor: 1)."""
    art = gguf_artifact(tmp_path / "gguf")
    shown = json.loads(cli("inspect", art / "m-Q8_0.gguf", "--json", check=True).stdout)
    assert shown["method"] == "gguf" and shown["gguf"][0]["type"] == "Q8_0"
    assert shown["manifest"]["ok"] is True and shown["manifest"]["checked"] == 1
    with open(art / "m-Q8_0.gguf", "ab") as f:
        f.write(b"\0")
    bad = cli("inspect", art / "m-Q8_0.gguf")
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout and "m-Q8_0.gguf" in bad.stderr, bad.stderr
    (tmp_path / "fake.gguf").write_bytes(os.urandom(4096))
    fake = cli("inspect", tmp_path / "fake.gguf")
    assert fake.returncode == 1 and fake.stdout == "" and "fake.gguf is not a readable GGUF file" in fake.stderr
    assert "Traceback" not in fake.stderr and len(fake.stderr.strip().splitlines()) == 2  # the error and its hint


@pytest.mark.cli
def test_inspect_and_doctor_take_a_release_folder(tmp_path: Path, cli) -> None:
    """Both exited 2 on a release folder ('neither .gguf files nor a checkpoint'), which verify, eval and publish
    take: inspect shows each artifact and the release's SHA256SUMS check, doctor checks each artifact."""
    rel = tmp_path / "rel"
    gguf_artifact(rel / "a")
    gguf_artifact(rel / "b")
    lines = [f"{sha256_file(p)}  {p.relative_to(rel).as_posix()}" for p in integrity.release_files(rel)]
    (rel / integrity.SUMS).write_text("\n".join(lines) + "\n")
    shown = json.loads(cli("inspect", rel, "--json", check=True).stdout)
    assert [Path(a["path"]).name for a in shown["artifacts"]] == ["a", "b"]
    assert all(a["manifest"]["ok"] for a in shown["artifacts"]) and shown["release"]["ok"] is True
    (rel / "report.md").write_text("# mine")
    proc = cli("inspect", rel)
    assert proc.returncode == 1 and "release" in proc.stdout and "report.md" in proc.stderr, proc.stderr
    doctor = cli("doctor", rel, "--json", timeout=300)
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    parts = json.loads(doctor.stdout)["artifacts"]
    assert [Path(p["artifact"]["path"]).name for p in parts] == ["a", "b"]
    assert all(p["engine"]["name"] == "llama.cpp" and p["ok"] for p in parts)


def test_update_manifest_seals_what_quantkit_wrote_and_nothing_else(tmp_path: Path) -> None:
    """It re-hashed every file on disk, so recording a result (smoke, eval) sealed a changed weight file or a file
    dropped into the folder as quantkit's, and verify vouched for the tampered artifact. Now only quantkit's own
    post-seal files (a report, the model card, logs) get new hashes; any other difference is refused."""
    out = tmp_path / "art"
    make(out)
    (out / "report.md").write_text("# quantkit evaluation\n\nfirst")
    (out / integrity.LOGS).mkdir()
    (out / integrity.LOGS / "a.smoke-llama.cpp.log").write_text("served")
    m = integrity.update_manifest(out, evaluation={"ppl": 1.0})
    assert m.evaluation.model_dump(exclude_unset=True) == {"ppl": 1.0}
    assert {"report.md", "logs/a.smoke-llama.cpp.log"} <= set(m.files) and integrity.verify(out).ok
    (out / "report.md").write_text("# quantkit evaluation\n\nsecond run")  # a re-run rewrites it: sealed anew
    assert integrity.update_manifest(out, evaluation={"ppl": 2.0}).files["report.md"].size == 33
    assert integrity.verify(out).ok


TAMPERS = {
    "changed weights": (lambda a: (a / "model.safetensors").write_bytes(b"weightz"), "changed ['model.safetensors']"),
    "added file": (lambda a: (a / "evil.sh").write_text("#!/bin/sh"), "not listed ['evil.sh']"),
    "report not quantkit's": (lambda a: (a / "report.md").write_text("# mine\n"), "not listed ['report.md']"),
    "missing file": (lambda a: (a / "sub" / "tokenizer.json").unlink(), "missing ['sub/tokenizer.json']"),
}


@pytest.mark.parametrize("tamper", TAMPERS)
def test_update_manifest_refuses_a_tampered_artifact_and_writes_nothing(tmp_path: Path, tamper: str) -> None:
    out = tmp_path / "art"
    make(out)
    change, found = TAMPERS[tamper]
    change(out)
    before = (out / MANIFEST).read_bytes()
    with pytest.raises(IntegrityError, match=re.escape(found)):
        integrity.update_manifest(out, smoke={"runs": {}})
    assert (out / MANIFEST).read_bytes() == before and not integrity.verify(out).ok


@pytest.mark.cli
def test_size_is_the_weight_files_everywhere(tmp_path: Path, cli) -> None:
    out = tmp_path / "art"
    make(out, b"W" * 4096)
    assert size_bytes(out) == read_manifest(out).size_bytes == 4096
    shown = json.loads(cli("inspect", out, "--json", check=True).stdout)
    assert shown["size_bytes"] == 4096


def legacy_artifact(final: Path) -> Path:
    """An artifact as ``--format gptq`` lays it out: the model at the top, the same weights again under ``gptq/``
    (what an AutoGPTQ loader is given), both sealed, the manifest's ``quantization.legacy`` naming the folder."""
    with artifact.ArtifactWriter(final) as w:
        (w.path / "config.json").write_text("{}")
        (w.path / "model.safetensors").write_bytes(b"W" * 4096)
        (w.path / "gptq").mkdir()
        (w.path / "gptq" / "config.json").write_text("{}")
        (w.path / "gptq" / "model.safetensors").write_bytes(b"G" * 4000)
        w.commit(Manifest(kind="compressed-tensors", method="gptq", source=SOURCE,
                                   quantization={"scheme": "W4A16", "legacy": {"path": "gptq"}}))
    return final


@pytest.mark.cli
def test_a_legacy_layouts_copy_is_not_counted_in_the_size(tmp_path: Path, cli) -> None:
    """Both copies were counted: an int4 model came out '0.90x smaller' than its source, 17.87 bits per weight."""
    out = legacy_artifact(tmp_path / "art")
    m = read_manifest(out)
    assert m.size_bytes == size_bytes(out) == 4096 and m.legacy_bytes == 4000
    assert {"gptq/model.safetensors", "gptq/config.json", "model.safetensors"} <= set(m.files)  # all still sealed
    assert json.loads(cli("inspect", out, "--json", check=True).stdout)["size_bytes"] == 4096
    assert make(tmp_path / "plain").legacy_bytes == 0


@pytest.mark.cli
def test_verify_a_folder_inside_an_artifact_against_its_manifest(tmp_path: Path, cli) -> None:
    """``verify ART/gptq`` (the legacy layout an AutoGPTQ loader is given) exited 2, 'has no quantkit.json'."""
    out = legacy_artifact(tmp_path / "art")
    shown = json.loads(cli("verify", out / "gptq", "--json", check=True).stdout)
    assert [(r["ok"], r["checked"], r["seal"]) for r in shown] == [(True, 2, "quantkit.json")]
    assert cli("verify", "gptq", cwd=out, check=True).stdout.startswith("ok ")  # a relative path, from inside
    (out / "gptq" / "model.safetensors").write_bytes(b"H" * 4000)
    (out / "gptq" / "mine.txt").write_text("mine")
    (out / "gptq" / "config.json").unlink()
    proc = cli("verify", out / "gptq", "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [r] = json.loads(proc.stdout)
    assert (r["changed"], r["missing"], r["extra"]) == (["gptq/model.safetensors"], ["gptq/config.json"],
                                                        ["gptq/mine.txt"])
    (out / "mine").mkdir()
    (out / "mine" / "x").write_text("x")
    assert cli("verify", out / "mine").returncode == 2  # a folder the artifact does not hold: not quantkit's


@pytest.mark.cli
def test_manifests_of_earlier_versions_still_open_and_verify(tmp_path: Path, cli) -> None:
    """A schema-1 manifest (written by quantkit 0.1.0 before the typed manifest, kept in tests/data) reads into the
    typed object, and an artifact sealed with that layout verifies, inspects and finds its source model."""
    v1 = json.loads((Path(__file__).parent / "data" / "manifest-v1.json").read_text())
    assert v1["schema"] == 1 and "schema_version" not in v1
    m = Manifest.from_json(v1)
    assert m.schema_version == 1 and m.method == "gptq" and m.calibration.samples == 4
    assert m.kind == "compressed-tensors"  # schemas 1 and 2 named the kind "format"
    assert m.source.id == "models/quantkit-tiny" and not m.source.hub
    assert m.evaluation.results[0]["ppl"] > 1 and m.size_bytes == v1["files"]["model.safetensors"]["size"]
    out = tmp_path / "old"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"old weights")
    v1["files"] = {name: {"sha256": sha256_file(out / name), "size": (out / name).stat().st_size}
                   for name in ("config.json", "model.safetensors")}
    (out / "quantkit.json").write_text(json.dumps(v1))
    assert json.loads(cli("verify", out, "--json", check=True).stdout)[0]["ok"] is True
    assert json.loads(cli("inspect", out, "--json", check=True).stdout)["method"] == "gptq"
    assert read_manifest(out).source.local_path() == Path("models/quantkit-tiny")


def test_a_manifest_from_a_newer_quantkit_is_refused_clearly(tmp_path: Path) -> None:
    out = tmp_path / "new"
    make(out)
    data = json.loads((out / "quantkit.json").read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    (out / "quantkit.json").write_text(json.dumps(data))
    with pytest.raises(UsageError, match="newer than this quantkit"):
        read_manifest(out)


def test_a_schema_2_manifest_names_its_kind_format_and_is_read(tmp_path: Path) -> None:
    """Schema 2 wrote the kind under "format"; it reads as the kind, and a manifest written now says "kind"."""
    make(tmp_path / "art")
    data = json.loads((tmp_path / "art" / MANIFEST).read_text())
    assert data["kind"] == "test" and "format" not in data
    data["schema_version"] = 2
    data["format"] = data.pop("kind")
    assert Manifest.from_json(data).kind == "test"


def test_a_swap_cut_short_is_put_right_by_the_next_writer(tmp_path: Path) -> None:
    """A run killed between the --force swap's two renames leaves the old artifact hidden as .NAME.old-PID and
    nothing at the output; one killed while removing it leaves that copy beside the new one. The next writer of the
    output (holding its lock, so nobody else is writing it) puts the first back and removes the second."""
    out = tmp_path / "art"
    make(out, b"v1")
    os.replace(out, tmp_path / ".art.old-999999")
    with pytest.raises(OutputExistsError, match="already exists"):  # the old artifact is back, and not replaced
        make(out, b"v2")
    assert (out / "model.safetensors").read_bytes() == b"v1" and integrity.verify(out).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    shutil.copytree(out, tmp_path / ".art.old-999998")
    make(out, b"v3", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert (out / "model.safetensors").read_bytes() == b"v3"


def test_a_swap_whose_second_rename_fails_puts_the_old_artifact_back(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "art"
    make(out, b"v1")
    real = os.replace

    def replace(src: Path, dst: Path) -> None:
        if Path(src).name.startswith(".art.partial-"):  # the new artifact renamed in, the old one already away
            raise PermissionError(13, "Permission denied", str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(PermissionError):
        make(out, b"v2", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert (out / "model.safetensors").read_bytes() == b"v1"


def _fill_with(how: str, folder: Path) -> None:
    """Write 4 MiB the way a library does: safetensors (SafetensorError), torch.save (a RuntimeError that says
    nothing of the disk), Python's own file (OSError)."""
    if how == "open":
        (folder / "model.bin").write_bytes(b"\0" * (4 << 20))
        return
    import torch

    if how == "safetensors":
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(1 << 20)}, str(folder / "model.safetensors"))
    else:
        torch.save({"w": torch.zeros(1 << 20)}, folder / "model.pt")


@pytest.mark.parametrize("how", ["safetensors", "torch", "open"])
def test_a_disk_that_fills_while_writing_is_one_clear_error(tmp_path: Path, how: str) -> None:
    """SafetensorError ("No space left on device (os error 28)") is no OSError, and torch.save's RuntimeError names
    no errno ("unexpected pos ..."): both escaped as tracebacks. However the library wraps ENOSPC, it is the
    documented DiskSpaceError, and the partial folder is removed."""
    from test_reliability import tmpfs

    disk = tmpfs(tmp_path / "disk", "2m")
    try:
        with pytest.raises(DiskSpaceError, match="disk filled up while writing .*art; the partial output was removed"):
            with artifact.ArtifactWriter(disk / "art") as w:
                _fill_with(how, w.path)
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)  # a failed run may still hold a file open


def test_a_library_error_on_a_disk_with_room_is_not_called_a_full_disk(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with artifact.ArtifactWriter(tmp_path / "art"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert list(tmp_path.iterdir()) == []


def _relist(out: Path, name: str, target: Path) -> None:
    """Make the manifest list ``name`` (instead of config.json) with ``target``'s true sha256 and size."""
    data = json.loads((out / MANIFEST).read_text())
    del data["files"]["config.json"]
    data["files"][name] = {"sha256": sha256_file(target), "size": target.stat().st_size}
    (out / MANIFEST).write_text(json.dumps(data))


def test_verify_refuses_a_seal_naming_files_outside_the_folder(tmp_path: Path) -> None:
    """A manifest entry "../afile" with that file's sha256 made verify read it and say ok; "/etc/hostname" was a
    ValueError traceback (verify and inspect). Such a manifest is corrupt (exit 1, naming the entry), and so is one
    whose entry leads out through a symbolic link; a release's SHA256SUMS follows the same rule."""
    (tmp_path / "afile").write_text("not the artifact's")
    for name in ("../afile", str(tmp_path / "afile"), "sub/../../afile", "./config.json"):
        out = tmp_path / "art"
        make(out)
        _relist(out, name, tmp_path / "afile")
        with pytest.raises(IntegrityError, match=f"files: .*{re.escape(repr(name))} is not the name of a file inside"):
            integrity.verify_tree(out)
        shutil.rmtree(out)
    make(out)
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(out / "config.json", tmp_path / "elsewhere")
    (out / "config.json").unlink()
    (out / "link").symlink_to(tmp_path / "elsewhere")
    _relist(out, "link/config.json", tmp_path / "elsewhere" / "config.json")
    with pytest.raises(IntegrityError, match="lists link/config.json, which a symbolic link leads outside"):
        integrity.verify_tree(out)
    rel = _release(tmp_path / "rel")
    for line in (f"{'0' * 64}  /etc/hostname", f"{'0' * 64}  rtn/../../afile"):
        (rel / integrity.SUMS).write_text(line + "\n")
        with pytest.raises(IntegrityError, match="line 1: not '<sha256>  <file>' with a file inside the folder"):
            integrity.verify_tree(rel)
    (rel / "out").symlink_to(tmp_path / "elsewhere")
    (rel / integrity.SUMS).write_text(f"{sha256_file(tmp_path / 'afile')}  out/config.json\n")
    with pytest.raises(IntegrityError, match="lists out/config.json, which a symbolic link leads outside"):
        integrity.verify_tree(rel)


@pytest.mark.cli
def test_verify_and_inspect_cli_on_a_manifest_naming_a_file_outside(tmp_path: Path, cli) -> None:
    out = tmp_path / "art"
    make(out)
    _relist(out, "/etc/hostname", out / "config.json")
    for verb in ("verify", "inspect"):
        proc = cli(verb, out)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.splitlines() == [f"error: {out / MANIFEST} is not a quantkit manifest: files: "
                                            "Value error, '/etc/hostname' is not the name of a file inside the "
                                            "artifact folder"]


def test_the_lock_refuses_an_output_it_cannot_be_made_beside(tmp_path: Path) -> None:
    """What takes the lock before the outputs are checked (run's release folder) got mkdir's FileExistsError or
    open's FileNotFoundError as a traceback: it is one line, exit 2."""
    (tmp_path / "afile").write_text("mine")
    for out, said in ((tmp_path / "afile" / "sub", "File exists"), (Path("/proc/qk-out"), "No such file")):
        with pytest.raises(UsageError, match=f"cannot write {out}: .*{said}"):
            with output_lock(out):
                pass
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.cli
def test_a_refused_run_leaves_none_of_the_folders_it_made(cli, tmp_path: Path) -> None:
    """The lock makes the output's missing parents; a run refused after it (here the device, checked once the lock
    is held) left them behind empty. A run that writes its artifact keeps them."""
    proc = cli("rtn", "models/quantkit-tiny", tmp_path / "p" / "q" / "r", "--device", "cuda:99")
    assert proc.returncode == 2 and not (tmp_path / "p").exists(), proc.stderr
    (tmp_path / "p").mkdir()  # a folder that was there before stays
    with output_lock(tmp_path / "p" / "q" / "r"):
        pass
    assert [d.name for d in tmp_path.iterdir()] == ["p"] and not any((tmp_path / "p").iterdir())
    with output_lock(tmp_path / "x" / "y" / "art"):
        (tmp_path / "x" / "y" / "art").mkdir()
    assert (tmp_path / "x" / "y" / "art").is_dir()


def test_a_waiter_never_shares_the_lock_with_a_newcomer(tmp_path: Path) -> None:
    """The holder removes its lock file on the way out. A run that waited on that file must not then hold a lock on
    a file no one else can find while a newcomer locks a fresh one at the path: two writers of one artifact."""
    import threading

    from quantkit.errors import LockedError

    final = tmp_path / "art"
    got, release = threading.Event(), threading.Event()

    def waiter() -> None:
        with output_lock(final, wait=True):
            got.set()
            release.wait(10)

    with output_lock(final):
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)  # the waiter is blocked on this holder's lock file
    assert got.wait(10)
    try:
        with pytest.raises(LockedError):
            with output_lock(final):
                pass
    finally:
        release.set()
        t.join(10)


def test_verify_of_a_path_that_is_not_there_says_so(tmp_path: Path) -> None:
    from quantkit.errors import UsageError

    with pytest.raises(UsageError, match="does not exist"):  # it said the path had no quantkit.json
        integrity.verify_tree(tmp_path / "nowhere")


def test_verify_names_links_and_special_files_added_to_an_artifact_or_a_release(tmp_path: Path) -> None:
    """Only regular files were looked for on disk: a link to a folder outside (its files reachable through the
    artifact), a dangling link, a link loop or a FIFO added to an artifact or a release passed verify. Each is now
    not listed (exit 1), named once (a linked folder is not entered), and a FIFO is never read."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "extra.safetensors").write_bytes(b"not sealed")
    out = tmp_path / "art"
    for name, add in (("linked", lambda p: p.symlink_to(tmp_path / "elsewhere")),
                      ("dangling", lambda p: p.symlink_to(tmp_path / "nowhere")),
                      ("loop", lambda p: p.symlink_to(p.name)),
                      ("fifo", os.mkfifo)):
        make(out)
        add(out / "sub" / name)
        res = integrity.verify_tree(out)[0]
        assert not res.ok and res.extra == [f"sub/{name}"] and res.changed == res.missing == [], name
        assert integrity.verify_tree(out / "sub")[0].extra == [f"sub/{name}"], name  # the folder alone, as a file
        shutil.rmtree(out)
    rel = _release(tmp_path / "rel")
    (rel / "linked").symlink_to(tmp_path / "elsewhere")
    os.mkfifo(rel / "fifo")
    assert integrity.verify_tree(rel)[-1].extra == ["fifo", "linked"]


def test_verify_names_a_hidden_file_added_to_a_release(tmp_path: Path) -> None:
    """A release's SHA256SUMS left out every hidden file, to leave out locks and temporary files: a `.env` or any
    dot-file added to a release (at its top, in logs/) passed verify, though an artifact's check names one. Only
    quantkit's own leftovers (a killed run's `.NAME.lock`, write_text_atomic's temporary) are left out now; a
    hidden file that was there when the release was sealed is listed, and verify passes it."""
    rel = tmp_path / "rel"
    make(rel / "rtn")
    (rel / "logs").mkdir()
    (rel / ".keep").write_text("the user's, before the run")
    _seal_release(rel, {})
    assert ".keep" in (rel / integrity.SUMS).read_text() and integrity.verify_tree(rel)[-1].ok
    (rel / ".rtn.lock").write_text("123")  # output_lock's, left by a killed run
    (rel / ".report.md.tmp-123").write_text("half")
    assert integrity.verify_tree(rel)[-1].ok
    (rel / ".env").write_text("TOKEN=x")
    (rel / "logs" / ".hidden.log").write_text("x")
    assert integrity.verify_tree(rel)[-1].extra == [".env", "logs/.hidden.log"]


@pytest.mark.cli
def test_a_fifo_where_a_file_is_read_is_one_error_not_a_hang(tmp_path: Path, cli) -> None:
    """A FIFO at quantkit.json hung verify and inspect, and one at config.json or a weight file hung inspect: each
    was opened and read, and a FIFO without a writer blocks for ever. Each is now one line naming it, exit 1."""
    for name, verbs in ((MANIFEST, ("verify", "inspect")), ("config.json", ("inspect",)),
                        ("model.safetensors", ("inspect",))):
        out = tmp_path / "art"
        make(out)
        (out / name).unlink()
        os.mkfifo(out / name)
        for verb in verbs:
            for json_flag in ((), ("--json",)):
                proc = cli(verb, out, *json_flag, timeout=30)
                assert proc.returncode == 1 and "Traceback" not in proc.stderr, (verb, name, proc.stderr)
                assert f"error: {out / name} is a FIFO, not a file" in proc.stderr, (verb, name, proc.stderr)
                if json_flag:
                    assert json.loads(proc.stdout)["exit_code"] == 1
        shutil.rmtree(out)


def test_verify_names_a_file_added_whatever_its_name(tmp_path: Path) -> None:
    """Every name ending in ``.lock`` was taken for one of quantkit's locks and left out, so a ``payload.lock`` added
    to a sealed artifact passed verify; quantkit's own locks are ``.NAME.lock`` and the only names left out."""
    out = tmp_path / "art"
    make(out)
    (out / "sub" / "payload.lock").write_bytes(b"not sealed")
    (out / ".art.lock").write_bytes(b"")  # a name of quantkit's lock files: not the artifact's
    res = integrity.verify_tree(out)[0]
    assert not res.ok and res.extra == ["sub/payload.lock"], res.extra


def test_a_manifest_digest_of_the_wrong_form_is_named_not_read_as_a_changed_file(tmp_path: Path) -> None:
    """A sha256 written in capitals (or not hex) in quantkit.json compared unequal to the file's and verify said the
    file had changed; the manifest is what is wrong, and verify says so."""
    out = tmp_path / "art"
    make(out)
    data = json.loads((out / MANIFEST).read_text())
    name, info = next(iter(data["files"].items()))
    info["sha256"] = info["sha256"].upper()
    (out / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(IntegrityError, match=f"is not a quantkit manifest: files.{re.escape(name)}.sha256"):
        integrity.verify_tree(out)
