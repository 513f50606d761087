"""Writing an artifact folder: atomically, locked while written, sealed by ``quantkit.json``, never over the user's
files.

An artifact is produced into a temporary sibling folder (``.NAME.partial-PID``) and renamed into place only
once complete and its manifest is written, so a folder at the output path is always a finished artifact. An
existing output is refused without ``force``; with it, the old folder is replaced only after the new one is
complete, and only when it is one quantkit wrote (a folder with a quantkit manifest, holding nothing its manifest
does not list but what quantkit itself adds later) or an empty folder (:func:`check_replaceable`): ``--force``
never removes a file of the user's. The swap (old renamed to ``.NAME.old-PID``, new renamed in, old removed) is
not split by Ctrl-C, and the next writer puts right one a crash split. A lock file beside the output stops two
runs writing the same artifact at once (:mod:`quantkit.locks`). Free space is checked against the expected size
before writing, and a disk that fills while writing is a clear error however the library reports it
(:func:`_disk_full`).

What the manifest records is :mod:`quantkit.manifest`'s; how a folder is checked against it afterwards,
:mod:`quantkit.integrity`'s.
"""

from __future__ import annotations

import errno
import glob
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from quantkit import interrupts, seal
from quantkit.errors import DiskSpaceError, IntegrityError, LockedError, OutputExistsError, QuantkitError, UsageError, \
    existing
from quantkit.integrity import unlisted
from quantkit.locks import output_lock
from quantkit.manifest import MANIFEST, FileInfo, Manifest, is_artifact_file, now_iso, read_manifest, write_manifest
from quantkit.progress import fmt_bytes

# What a run writing the output NAME leaves beside it only if it is killed: the folder it builds (``.NAME.partial-PID``)
# and the one a ``--force`` swap moves aside (``.NAME.old-PID``), group 1 the output's name.
LEFTOVER = re.compile(r"\.(.+)\.(?:partial|old)-[0-9]+")


def free_space_asked(needed: int) -> int:
    """The free space :func:`check_free_space` asks for an artifact whose plan needs ``needed`` bytes: 10% more, for
    what the estimate leaves out. bench/wide.py plans a machine's disk by it."""
    return math.ceil(needed * 1.1)


def check_free_space(where: Path, needed: int) -> None:
    """Refuse to start when the file system cannot hold the artifact (:func:`free_space_asked`)."""
    probe = existing(where)
    free = shutil.disk_usage(probe).free
    if free_space_asked(needed) > free:
        raise DiskSpaceError(
            f"not enough free space in {probe}: the artifact needs about {fmt_bytes(free_space_asked(needed))}, "
            f"{fmt_bytes(free)} is free", hint="free some space or write the output elsewhere")


def check_replaceable(path: Path) -> None:
    """What ``--force`` may replace: a folder holding a readable quantkit manifest (an artifact) and nothing else
    but the files it lists and what quantkit writes there after sealing it (:func:`quantkit.integrity.unlisted`), or
    an empty folder. Anything else (a file, a link, a folder quantkit did not write, an artifact whose manifest no
    longer reads, an artifact the user put files into) is the user's: refused, never removed."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        raise OutputExistsError(f"output {path} exists and is not a folder quantkit wrote",
                                hint="remove it yourself, or choose another output")
    if not any(path.iterdir()):
        return
    try:
        manifest = read_manifest(path)
    except (UsageError, IntegrityError) as e:
        why = f"it has no {MANIFEST}" if not (path / MANIFEST).exists() else \
            f"its {MANIFEST} does not read ({e.message})"
        raise OutputExistsError(f"output {path} exists and was not written by quantkit: {why}; --force replaces "
                                "only quantkit's artifacts and empty folders",
                                hint="remove it yourself, or choose another output") from None
    theirs = unlisted(path, manifest)
    if theirs:
        shown = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
        raise OutputExistsError(f"output {path} holds files its {MANIFEST} does not list: {shown}; --force "
                                "would remove them with the artifact",
                                hint=f"move them out of {path}, or choose another output")


def check_output(final: Path, force: bool) -> None:
    """What the output path may hold before an artifact is written there: nothing, or with ``force`` what
    :func:`check_replaceable` allows. The writer asks under its lock; :func:`quantkit.api.quantize_one` asks first,
    so what the command line alone decides is refused before the source is hashed or checked."""
    there = final.exists() or final.is_symlink()
    if there and not force:
        raise OutputExistsError(f"output {final} already exists",
                                hint="pass --force to replace it, or choose another output")
    if there:
        check_replaceable(final)


class ArtifactWriter:
    """Write an artifact into a temporary sibling, seal it with a manifest, rename it into place.

    Use as a context manager: inside, write into :attr:`path`; call :meth:`commit` with the manifest sections.
    Leaving the block without committing (an error, Ctrl-C, SIGTERM) removes the temporary folder, so nothing
    half-written ever sits at the output path. Putting the new artifact in place, removing the old one and removing
    the temporary folder each finish once begun: a Ctrl-C then waits for them (:func:`interrupts.deferred`), so
    the output path always holds the old artifact or the new one, whole, and the message after a stop is true.
    """

    def __init__(self, final: Path, *, force: bool = False, expected_bytes: int = 0) -> None:
        self.final = Path(final)
        self.force = force
        self.expected_bytes = expected_bytes
        self.path = self.final.parent / f".{self.final.name}.partial-{os.getpid()}"
        self.committed = False
        self._lock = output_lock(self.final)

    def __enter__(self) -> "ArtifactWriter":
        self._lock.__enter__()
        try:
            _recover(self.final)
            check_output(self.final, self.force)
            check_free_space(self.final.parent, self.expected_bytes)
            self.path.mkdir(parents=True)
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        self._sealer = seal.Sealer(self.path, lambda p: is_artifact_file(p, self.path)).start()
        return self

    def commit(self, manifest: Manifest) -> Manifest:
        """Hash every file into ``manifest.files``, write ``quantkit.json``, and move the folder into place
        (replacing on ``force``).

        Refuses if a stop was asked for, even one a library swallowed: a run told to stop never publishes. A stop
        that arrives once the new artifact is going into place waits for it (and for the old one's removal), then
        is raised saying so: the output is the new artifact, whole.
        """
        interrupts.check()
        t0 = time.perf_counter()
        digests = self._sealer.finish()  # what was not sealed while it was written is hashed and fsynced now
        files = dict(sorted((p.relative_to(self.path).as_posix(), FileInfo(sha256=d, size=p.stat().st_size))
                            for p, d in digests.items()))
        # quantkit's own cost after "total" (which ends when the producer does), so the manifest accounts for it
        timings = {**manifest.timings, "hash_and_sync": round(time.perf_counter() - t0, 3)}
        data = manifest.model_copy(update={"files": files, "created": now_iso(), "timings": timings})
        write_manifest(self.path, data)
        _share(self.path)
        seal.fsync_file(self.path / MANIFEST)
        replacing = self.final.exists() or self.final.is_symlink()
        if replacing:
            check_replaceable(self.final)  # still what --force may replace, now that the new one is complete
        try:
            with interrupts.deferred():
                interrupts.check()  # one a library swallowed while the files were hashed
                if replacing:
                    self._swap()
                else:
                    os.replace(self.path, self.final)
                self.committed = True
        except interrupts.Stopped as e:
            if not self.committed:
                raise
            done = "; the old artifact was removed" if replacing else ""
            raise interrupts.Stopped(e.signum, f"as {self.final} was put in place: it holds the new artifact, "
                                               f"complete and sealed{done}") from None
        return data

    def _swap(self) -> None:
        """Replace the artifact at the output path by the new one: the old one renamed away, the new one renamed in
        (the old one renamed back if that fails), then the old one removed. Called with signals deferred; a crash
        between the renames leaves ``.NAME.old-PID``, which the next writer of this output puts back."""
        old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
        os.replace(self.final, old)
        try:
            os.replace(self.path, self.final)
        except OSError:
            os.replace(old, self.final)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        full = exc is not None and not self.committed and _disk_full(exc, self.path)  # before the cleanup frees it
        try:
            with interrupts.deferred():  # a second Ctrl-C waits: the message after it says the folder was removed
                self._sealer.close()
                if not self.committed:
                    shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._lock.__exit__(None, None, None)
        if full:
            raise DiskSpaceError(f"the disk filled up while writing {self.final}; the partial output was removed",
                                 hint="free some space or write the output elsewhere") from None


def _recover(final: Path) -> None:
    """What a run killed mid-way left beside the output ``final`` (the caller holds its lock: nobody else is writing
    it): its temporary folders are removed; the old artifact a ``--force`` swap had renamed away (``.NAME.old-PID``)
    is put back where the output path is empty (killed between the two renames), else removed (killed while
    removing it, once the new one was in place)."""
    parent, name = final.parent, final.name
    with interrupts.deferred():
        for stale in parent.glob(f".{glob.escape(name)}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        olds = parent.glob(f".{glob.escape(name)}.old-*")
        for old in sorted(olds, key=lambda p: p.stat().st_ctime, reverse=True):
            if final.exists() or final.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, final)  # the most recent one renamed away


def recover_leftovers(folder: Path) -> None:
    """What killed runs left in ``folder`` beside its outputs (:data:`LEFTOVER`), recovered output by output as a
    run building that output would (:func:`_recover`), under its lock. ``quantkit run`` does this in its release
    folder before it seals it: an output it reuses is not rebuilt, so a half-built copy of it from a killed
    ``--force`` run stayed, and was sealed into the release's ``SHA256SUMS``. An output another run is writing now
    is left to that run."""
    names = sorted({m.group(1) for p in folder.iterdir() if (m := LEFTOVER.fullmatch(p.name))})
    for name in names:
        try:
            with output_lock(folder / name):
                _recover(folder / name)
        except LockedError:
            continue


_FULL_BELOW = 1 << 20  # a write failed with less than this left: the disk filled up
_FULL_WORDS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), f"os error {errno.ENOSPC}",
               f"os error {errno.EDQUOT}")


def _disk_full(exc: BaseException, where: Path) -> bool:
    """Whether an error raised while an artifact was written means its disk filled up, however the library wrapped
    ENOSPC: an OSError with that errno anywhere in the exception's chain, a message saying so (safetensors'
    SafetensorError: "No space left on device (os error 28)"), or, for a library's own exception that says nothing
    of it (torch.save's RuntimeError: "unexpected pos 576 vs 534"), a file system left with no space or no inodes
    as it is raised. Not a stop (KeyboardInterrupt) nor quantkit's own refusals, which say what they are."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    for e in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(word in str(e) for word in _FULL_WORDS):
            return True
    if not isinstance(exc, Exception) or isinstance(exc, QuantkitError):
        return False
    try:
        st = os.statvfs(existing(where))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _FULL_BELOW or (st.f_files > 0 and st.f_favail == 0)


def _share(root: Path) -> None:
    """Give every file and folder of an artifact the same mode, what the umask allows (0644/0755 with the usual
    022): libraries write some files owner-only (safetensors via mkstemp, ModelOpt's exports), and a serving
    container running as another user, or a shared model store, must be able to read all of it."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [root, *root.rglob("*")]:
        if p.is_dir():
            p.chmod(0o777 & ~mask)
        elif p.is_file():
            p.chmod(0o666 & ~mask)

