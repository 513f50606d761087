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
