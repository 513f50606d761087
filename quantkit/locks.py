"""The lock that stops two quantkit runs writing one output at once.

Not the artifact writer's alone (:class:`quantkit.artifact.ArtifactWriter`): ``quantkit run`` locks a release folder
of several outputs for the whole run, and ``smoke`` the artifact whose manifest it records into, so each takes it
from here.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from quantkit.errors import DiskSpaceError, LockedError, UsageError

# The name of an output's lock file (``.NAME.lock`` beside it, :func:`output_lock`), which a killed run may leave:
# never one of an artifact's or a release's files.
LOCK = re.compile(r"\.(?:.*\.)?lock")


@contextmanager
def output_lock(final: Path, wait: bool = False) -> Iterator[None]:
    """An exclusive lock beside ``final`` so two runs never write one artifact at once.

    The lock is an ``flock`` on ``.NAME.lock``: the kernel releases it if the holder dies, so a crash never
    leaves a stale lock behind. A folder it cannot be made in is refused here too (exit 2), for callers that did
    not check first (:func:`quantkit.outputs.check_writable`). The folders above ``final`` that it makes are removed
    on the way out when nothing was written into them: a run refused once it held the lock leaves nothing behind.
    """
    lock_path = final.parent / f".{final.name}.lock"
    made = [d for d in (final.parent, *final.parent.parents) if not d.exists()]  # deepest first
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _refuse_lock(final, lock_path, e)
    fd = _open_lock(final, lock_path)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                raise LockedError(f"another quantkit process (pid {holder}) is writing {final}",
                                  hint="wait for it to finish, or write to another output") from None
            try:
                current = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            # The holder we waited on removed the file on its way out: a lock on that file is no one's, and a third
            # process may already hold the one now at the path. Lock that one instead.
            os.close(fd)
            fd = _open_lock(final, lock_path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        for step in (lambda: os.ftruncate(fd, 0), lock_path.unlink):  # unlinked while still held: a waiter then
            try:                                                       # finds the file gone and locks afresh
                step()
            except OSError:
                pass
        os.close(fd)
        for d in made:  # a run that wrote nothing leaves none of the folders it made: rmdir takes only empty ones
            try:
                d.rmdir()
            except OSError:
                break


def _open_lock(final: Path, lock_path: Path) -> int:
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        _refuse_lock(final, lock_path, e)


def _refuse_lock(final: Path, lock_path: Path, e: OSError) -> NoReturn:
    """A lock that cannot be made: a full disk, or a folder that cannot be written (one line, exit 2)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskSpaceError(f"no space left to start writing {final}: {e.strerror}",
                             hint="free some space or write the output elsewhere") from None
    raise UsageError(f"cannot write {final}: {e.filename or lock_path}: {e.strerror}",
                     hint="choose an output in a folder you can write") from None
