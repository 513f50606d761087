"""Artifact folders: written atomically, locked while written, described and sealed by ``quantkit.json``.

An artifact is produced into a temporary sibling folder (``.NAME.partial-PID``) and renamed into place only
once complete and its manifest is written, so a folder at the output path is always a finished artifact. An
existing output is refused without ``force``; with it, the old folder is replaced only after the new one is
complete. A lock file beside the output stops two runs writing the same artifact at once. Free space is
checked against the expected size before writing, and ENOSPC while writing becomes a clear error.

``quantkit.json`` records what the artifact is and how it was made, and the sha256 of every file, which
:func:`verify` re-checks (tampering, bit rot, an incomplete copy).
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit import __version__, interrupts
from quantkit.errors import DiskSpaceError, IntegrityError, LockedError, OutputExistsError, UsageError

MANIFEST = "quantkit.json"
MANIFEST_SCHEMA = 1
# Files written after sealing (by eval/smoke) that are re-hashed by update_manifest, never left unhashed.
_CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every regular file under ``root`` except the manifest itself, sorted by path."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".lock"):
            rel = p.relative_to(root).as_posix()
            out[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return out


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def environment() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()}


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of an artifact folder; raises :class:`UsageError` when there is none or it is unreadable."""
    path = root / MANIFEST
    if not path.exists():
        raise UsageError(f"{root} has no {MANIFEST}: it was not written by quantkit (or is incomplete)")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path} is unreadable or not JSON: {e}") from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a hidden temporary file and rename: an interrupted write leaves the old file or none,
    never a truncated one that reads as complete (a report, a SHA256SUMS)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def update_manifest(root: Path, **sections: Any) -> dict[str, Any]:
    """Add or replace top-level sections (``evaluation``, ``smoke``...) and re-hash files added since sealing."""
    data = read_manifest(root)
    for k, v in sections.items():
        data[k] = v
    data["files"] = hash_tree(root)
    data["updated"] = now_iso()
    _write_json_atomic(root / MANIFEST, data)
    return data


@dataclass
class VerifyResult:
    """What :func:`verify` found: files whose hash or size changed, went missing, or are not in the manifest."""

    root: Path
    checked: int = 0
    changed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.changed or self.missing or self.extra)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.root), "ok": self.ok, "checked": self.checked, "changed": self.changed,
                "missing": self.missing, "extra": self.extra}


def verify(root: Path, progress: Any = None) -> VerifyResult:
    """Re-hash every file against the manifest (the artifact's seal)."""
    data = read_manifest(root)
    files: dict[str, dict[str, Any]] = data.get("files", {})
    res = VerifyResult(root=root)
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*")
               if p.is_file() and p.name != MANIFEST and not p.name.endswith(".lock")}
    task = progress.add_task("verifying sha256", total=sum(f["size"] for f in files.values())) if progress else None
    for rel, info in files.items():
        p = root / rel
        if not p.exists():
            res.missing.append(rel)
            continue
        if p.stat().st_size != info["size"] or sha256_file(p) != info["sha256"]:
            res.changed.append(rel)
        res.checked += 1
        if progress:
            progress.advance(task, info["size"])
    res.extra = sorted(on_disk - set(files))
    return res


@contextmanager
def output_lock(final: Path, wait: bool = False) -> Iterator[None]:
    """An exclusive lock beside ``final`` so two runs never write one artifact at once.

    The lock is an ``flock`` on ``.NAME.lock``: the kernel releases it if the holder dies, so a crash never
    leaves a stale lock behind.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise LockedError(f"another quantkit process (pid {holder}) is writing {final}",
                              hint="wait for it to finish, or write to another output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)
        try:
            lock_path.unlink()
        except OSError:
            pass


def check_free_space(where: Path, needed: int, margin: float = 1.1) -> None:
    """Refuse to start when the file system cannot hold the artifact (plus a 10% margin)."""
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed * margin > free:
        raise DiskSpaceError(
            f"not enough free space in {probe}: the artifact needs about {fmt_bytes(int(needed * margin))}, "
            f"{fmt_bytes(free)} is free", hint="free some space or write the output elsewhere")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class ArtifactWriter:
    """Write an artifact into a temporary sibling, seal it with a manifest, rename it into place.

    Use as a context manager: inside, write into :attr:`path`; call :meth:`commit` with the manifest sections.
    Leaving the block without committing (an error, Ctrl-C, SIGTERM) removes the temporary folder, so nothing
    half-written ever sits at the output path.
    """

    def __init__(self, final: Path, *, force: bool = False, expected_bytes: int = 0) -> None:
        self.final = Path(final)
        self.force = force
        self.expected_bytes = expected_bytes
        self.path = self.final.parent / f".{self.final.name}.partial-{os.getpid()}"
        self.committed = False
        self._lock = output_lock(self.final)

    def __enter__(self) -> "ArtifactWriter":
        if self.final.exists() and not self.force:
            raise OutputExistsError(f"output {self.final} already exists",
                                    hint="pass --force to replace it, or choose another output")
        if self.final.exists() and not self.final.is_dir():
            raise OutputExistsError(f"output {self.final} exists and is not a folder")
        self._lock.__enter__()
        try:
            check_free_space(self.final.parent, self.expected_bytes)
            for stale in self.final.parent.glob(f".{self.final.name}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a killed run; we hold the lock now
            self.path.mkdir(parents=True)
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self

    def commit(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Hash every file, write ``quantkit.json``, and move the folder into place (replacing on ``force``).

        Refuses if a stop was asked for, even one a library swallowed: a run told to stop never publishes.
        """
        interrupts.check()
        data = {"schema": MANIFEST_SCHEMA, "quantkit_version": __version__, "created": now_iso(), **manifest,
                "environment": environment(), "files": hash_tree(self.path)}
        try:
            _write_json_atomic(self.path / MANIFEST, data)
            _fsync_tree(self.path)
            if self.final.exists():
                old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
                os.replace(self.final, old)
                os.replace(self.path, self.final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self.path, self.final)
        except OSError as e:
            raise _disk_error(e, self.final) from None
        self.committed = True
        return data

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if not self.committed:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._lock.__exit__(None, None, None)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _disk_error(exc, self.final) from None


def _disk_error(e: OSError, final: Path) -> Exception:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskSpaceError(f"the disk filled up while writing {final}; the partial output was removed",
                              hint="free some space or write the output elsewhere")
    return e


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
