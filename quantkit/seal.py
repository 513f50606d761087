"""Sealing an artifact's files (sha256 and fsync) while the artifact is still being written.

Sealing after the fact cost the 8B FP8 artifact 9.4 s on an H200 host (hashing 9 GB and waiting for the disk to
take it), a sixth of llm-compressor's whole run. A :class:`Sealer` runs beside the producer instead: it starts
the disk's writeback of every file as it grows, and hashes and fsyncs each file once it has been left alone for
:attr:`Sealer.quiet_s` (a finished shard, while the library writes the next). At :meth:`Sealer.finish`, a file
whose inode, size and modification time are still what they were when it was hashed keeps that hash; anything
else (a file written after it was hashed, or never hashed) is hashed and fsynced then. The result is therefore
what hashing everything at the end gives: the early work is kept only when the file provably did not change.

Files whose name starts with a dot are temporaries: safetensors writes ``.tmpXXXX`` and renames it when complete
(its writeback is started, as it becomes a file of the artifact); quantkit's own intermediates (the GGUF path's
``.NAME-f16.intermediate.gguf``) are left alone. Neither is hashed early; whatever is still there at
:meth:`Sealer.finish` is hashed then.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

_CHUNK = 1 << 22
_HASH_THREADS = min(8, os.cpu_count() or 1)
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the range's dirty pages, do not wait


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_many(paths: list[Path]) -> Iterator[tuple[Path, str]]:
    """(path, sha256) for each file, as each finishes, several files at once and the largest first.

    hashlib releases the GIL while it hashes, so a checkpoint in several shards is hashed at the speed of the disk
    or of several cores, not of one."""
    order = sorted(paths, key=lambda p: p.stat().st_size, reverse=True)
    if len(order) <= 1:
        yield from ((p, sha256_file(p)) for p in order)
        return
    with ThreadPoolExecutor(min(_HASH_THREADS, len(order))) as pool:
        futures = {pool.submit(sha256_file, p): p for p in order}
        for done in as_completed(futures):
            yield futures[done], done.result()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range() -> Callable[[int], int] | None:
    """Linux's sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE), or None where libc has none (macOS)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd: fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a failure only means no head start


_start_writeback = _sync_file_range()

Signature = tuple[int, int, int]  # inode, size, mtime in ns


def _signature(path: Path) -> Signature:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


class Sealer:
    """Hash and fsync the files under ``root`` while they are written (a daemon thread); :meth:`finish` gives the
    sha256 of every file, each on disk. ``include`` says which files count (the manifest itself does not)."""

    quiet_s = 1.0  # a file untouched this long is hashed now (a later write changes its signature: hashed again)
    poll_s = 0.2

    def __init__(self, root: Path, include: Callable[[Path], bool]) -> None:
        self.root = root
        self._include = include
        self._sealed: dict[Path, tuple[Signature, str]] = {}
        self._writeback: dict[Path, int] = {}  # size at the last writeback started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quantkit-sealer", daemon=True)
        self.early = 0  # files whose early hash was kept, for the record

    def start(self) -> Sealer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                for p in sorted(self.root.rglob("*")):
                    if self._stop.is_set():
                        return
                    self._visit(p)
            except OSError:
                continue  # a file renamed or removed under us: the next round (or finish) sees the new state

    def _visit(self, p: Path) -> None:
        if not p.is_file():
            return
        sig = _signature(p)
        if self._sealed.get(p, (None,))[0] == sig:
            return
        if p.name.startswith(".") or time.time_ns() - sig[2] < self.quiet_s * 1e9:
            # a visible file, or a library's temporary that becomes one; not an intermediate that will be deleted
            useful = not p.name.startswith(".") or p.name.startswith(".tmp")
            if _start_writeback and useful and self._writeback.get(p) != sig[1]:
                fd = os.open(p, os.O_RDONLY)
                try:
                    _start_writeback(fd)
                finally:
                    os.close(fd)
                self._writeback[p] = sig[1]
            return
        if not self._include(p):
            return
        digest = sha256_file(p)
        fsync_file(p)
        if _signature(p) == sig:
            self._sealed[p] = (sig, digest)

    def finish(self) -> dict[Path, str]:
        """Stop watching; the sha256 of every file (early hashes kept only for files that did not change since),
        every file fsynced."""
        self.stop()
        digests: dict[Path, str] = {}
        todo = []
        for p in sorted(p for p in self.root.rglob("*") if p.is_file() and self._include(p)):
            kept = self._sealed.get(p)
            if kept and kept[0] == _signature(p):
                digests[p] = kept[1]
            else:
                todo.append(p)
        self.early = len(digests)
        with ThreadPoolExecutor(1) as pool:  # the disk writes back while the files are hashed from the cache
            synced = pool.submit(lambda: [fsync_file(p) for p in todo])
            digests.update(hash_many(todo))
            synced.result()
        return digests
