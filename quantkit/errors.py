"""Errors users see, and the exit code each maps to.

Every error a user can cause or fix is a :class:`QuantkitError`: the CLI prints its message and hint on one or
two lines and exits with its code, with no traceback unless ``--debug`` is given.

Exit codes (documented in docs/usage.md and ``quantkit --help``):

* 0 - success
* 1 - failure (a backend failed, a file is corrupt, an engine would not load the artifact, a backend, engine or tool
  it needs is not installed)
* 2 - usage or recipe error (bad flags or recipe, missing input, existing output without ``--force``, an output
  that would overwrite the source, an input or a folder quantkit did not write)
* 3 - a verification gate failed
* 130 - interrupted (Ctrl-C or SIGTERM); temporary files were removed
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_GATE = 3
EXIT_INTERRUPTED = 130


def exit_text(rc: int) -> str:
    """How a child process ended, for a message: ``exited with code 1`` or ``was killed by SIGSEGV`` (a native
    crash in a tool or an engine says more than its negative return code)."""
    if rc < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


class QuantkitError(Exception):
    """Base class: a message for the user, an optional hint on what to do, and an exit code."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(QuantkitError):
    """Bad flags, bad input paths, or an output that exists without --force."""

    exit_code = EXIT_USAGE


class RecipeError(UsageError):
    """A recipe that fails validation: names the field, the line and what was expected."""


class SourceModelError(UsageError):
    """The source model is missing, unreadable, corrupt, untrusted or unsupported."""


class CalibrationError(UsageError):
    """A calibration or evaluation dataset that cannot be loaded or is too short."""


class OutputExistsError(UsageError):
    """The output exists and --force was not given."""


class UnsafeOutputError(UsageError):
    """An output that would overwrite or remove what the user has: the source checkpoint (the output is it, holds
    it or lies inside it) or an input file (inside an output that gets replaced)."""


class LockedError(UsageError):
    """Another quantkit process is writing the same output."""


class DiskSpaceError(QuantkitError):
    """Not enough free space for the artifact (checked before writing, and on ENOSPC while writing)."""


class HostMemoryError(QuantkitError):
    """The model cannot fit in this machine's memory (RAM and swap, or the container's limit): refused before
    loading, instead of the kernel killing the run minutes later."""


class MissingBackendError(QuantkitError):
    """A heavy optional backend is not installed: names the extra to install."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the Python package '{module}', which is not installed",
            hint=f"pip install 'quantkit[{extra}]'",
        )


class MissingEngineError(QuantkitError):
    """An engine (vLLM, SGLang) is not installed in the Python it would run in: says how to point at the environment
    where it is. Exit 1 with the other missing backends and tools: the command and its input are right, the machine
    lacks what runs them."""


class MissingToolError(QuantkitError):
    """A command-line tool (llama.cpp's llama-quantize...) is not installed: says how to get it."""


class BackendError(QuantkitError):
    """A backend library failed while working on a valid input."""


class IntegrityError(QuantkitError):
    """Files do not match the manifest's sha256 (tampering or bit rot)."""


class GateFailedError(QuantkitError):
    """A verification gate failed: which gate, the value and the limit."""

    exit_code = EXIT_GATE


class Interrupted(QuantkitError):
    """Ctrl-C or SIGTERM: raised so every ``with`` block cleans up on the way out."""

    exit_code = EXIT_INTERRUPTED


def path_error(e: OSError) -> UsageError | None:
    """The usage error for an ``OSError`` that a path raised at whichever check met it first, else None: a name too
    long for the filesystem (ENAMETOOLONG), or a path this user may not read, write or pass through (EACCES,
    EPERM: a folder on its way without search permission, a file without read permission).

    Why here, once: any path a user gives (a source, an output, a recipe, ``--calib``, an artifact to verify) can
    hold either, and ``Path.exists()`` raises on both rather than saying no, at whichever of dozens of checks meets
    it first; a fuzzed ``--calib=<400 digits>`` ended in a traceback, and so did every verb given a path below a
    folder its user could not search. Both are the user's to mend (exit 2); an error with no path is not this."""
    path = os.fsdecode(e.filename) if e.filename is not None else ""
    if e.errno == errno.ENAMETOOLONG:
        return too_long(path) or UsageError(f"a path too long for the filesystem ({len(os.fsencode(path)):,} "
                                            f"bytes): {_shown(path)!r}", hint="shorten the path")
    if e.errno in (errno.EACCES, errno.EPERM) and path:
        return UsageError(f"{(e.strerror or 'permission denied').lower()}: {path}",
                          hint="check the permissions of that path and of the folders above it, or give another")
    return None


def too_long(path: str) -> UsageError | None:
    """The usage error for a path with a name longer than its filesystem allows, else None: ``--dry-run`` asks it
    of an output below folders that do not exist yet, where nothing on the way raises until the run creates them."""
    try:
        limit = os.pathconf(existing(path), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    name = max(path.split(os.sep), key=lambda part: len(os.fsencode(part)), default="")
    size = len(os.fsencode(name))
    if size <= limit:
        return None
    return UsageError(f"a name too long for the filesystem: {_shown(name)!r} is {size:,} bytes, and a file or folder "
                      f"name holds at most {limit}", hint="shorten the path")


def _shown(name: str) -> str:
    """A long name as a message shows it: its start and its end."""
    return name if len(name) <= 40 else f"{name[:24]}…{name[-12:]}"


def existing(path: str | Path) -> Path:
    """The first of ``path`` and its parents that exists: the file system a file or folder not made yet will be on
    (its free space, its longest name). ``os.path.exists`` says no to a name too long, where ``Path.exists`` raises."""
    p = Path(path)
    while not os.path.exists(p) and p != p.parent:
        p = p.parent
    return p
