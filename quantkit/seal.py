"""Sealing an artifact's files (sha256 and fsync) while the artifact is still being written.

Sealing after the fact cost the 8B FP8 artifact 9.4 s on an H200 host (hashing 9 GB and waiting for the disk to
take it), a sixth of llm-compressor's whole run. A :class:`Sealer` runs beside the producer instead: it starts
the disk's writeback of every file as it grows, and has each file hashed and fsynced, by a pool of threads, once it
has been left alone for :attr:`Sealer.quiet_s` (a finished shard, while the library writes the next). With one
file hashed at a time, the three shards of that artifact still cost 4.5 s after the save (the first was being
hashed when the last landed); in parallel, the last shard is all that is left. At :meth:`Sealer.finish`, a file
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
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
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


def hash_and_sync(path: Path) -> str:
    """sha256 of ``path``, the file on disk when it returns: the fsync runs in a thread of its own while the hash
    reads the file (from the page cache), so a file costs the longer of the two, not their sum. The last shard of a
    checkpoint is what an artifact waits for after the save; on an H100 host the sealer's threads spent 9.5 s hashing
    and 6.1 s fsyncing the 8B FP8 artifact's ten shards of up to 1 GB, one after the other (about 1.0 and 0.7 s a
    GB; py-spy, bench/results/h100/8b/fp8_profile.md).

    The thread is joined before this returns or raises (an interrupt during that wait leaves it to end with its
    fsync: a daemon, it holds nothing and cannot keep the process alive). The hash's own exception wins (an
    interrupt while it reads is not turned into the fsync's OSError, which a caller such as :func:`_seal_one` would
    take for a file that changed); after a hash that succeeded, any error of the fsync is raised here, never left in
    its thread, so a digest returned always means the file is on disk."""
    failed: list[BaseException] = []

    def sync() -> None:
        try:
            fsync_file(path)
        except BaseException as e:  # anything, not only OSError: an error left in the thread would pass as synced
            failed.append(e)

    syncing = threading.Thread(target=sync, name="quantkit-fsync", daemon=True)
    syncing.start()
    try:
        digest = sha256_file(path)
    finally:
        syncing.join()
    if failed:
        raise failed[0]
    return digest


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
    """Hash and fsync the files under ``root`` while they are written (a watcher thread hands each file that has
    been left alone to a pool of hashing threads); :meth:`finish` gives the sha256 of every file, each on disk.
    ``include`` says which files count (the manifest itself does not)."""

    # A file untouched this long is hashed now. Safe at any value well above the file system's timestamp tick
    # (a later write changes the signature, and the file is hashed again); short, because the shards of a
    # checkpoint appear complete (renamed into place) and the last of them is what the artifact waits for.
    quiet_s = 0.1
    poll_s = 0.05

    def __init__(self, root: Path, include: Callable[[Path], bool]) -> None:
        self.root = root
        self._include = include
        self._jobs: dict[Path, tuple[Signature, Future[str | None]]] = {}
        self._writeback: dict[Path, int] = {}  # size at the last writeback started
        self._pool = ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="quantkit-seal")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quantkit-sealer", daemon=True)
        self.early = 0  # files whose early hash was kept, for the record

    def start(self) -> Sealer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (hashes already started run on; :meth:`finish` collects them)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def close(self) -> None:
        """Stop watching and drop the hashes not started (an artifact abandoned half-written: it is deleted now,
        and a hash in progress ends on its own)."""
        self.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

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
        if self._jobs.get(p, (None,))[0] == sig:
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
        if self._include(p):
            self._jobs[p] = (sig, self._pool.submit(_seal_one, p, sig))

    def finish(self) -> dict[Path, str]:
        """Stop watching; the sha256 of every file, every file fsynced. A hash made while the artifact was written
        is kept only for a file whose signature is still the one it was hashed with; the rest are hashed now, in
        parallel with those still in flight."""
        self.stop()
        jobs: dict[Path, Future[str | None]] = {}
        early: set[Path] = set()
        for p in sorted(p for p in self.root.rglob("*") if p.is_file() and self._include(p)):
            sig = _signature(p)
            job = self._jobs.get(p)
            if job and job[0] == sig:
                jobs[p] = job[1]
                early.add(p)
            else:
                jobs[p] = self._pool.submit(_seal_one, p, sig)
        digests: dict[Path, str] = {}
        for p, job in jobs.items():
            digest = job.result()
            if digest is None:  # changed or unreadable while it was hashed: once more, now that writing is over
                early.discard(p)
                digest = hash_and_sync(p)
            digests[p] = digest
        self._pool.shutdown()
        self.early = len(early)
        return digests


def _seal_one(p: Path, sig: Signature) -> str | None:
    """sha256 of ``p`` and its fsync, or None when the file no longer has signature ``sig`` afterwards (it was
    written meanwhile, so the digest may mix old and new bytes) or could not be read."""
    try:
        digest = hash_and_sync(p)
        return digest if _signature(p) == sig else None
    except OSError:
        return None
