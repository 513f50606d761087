"""Ctrl-C and SIGTERM that are never lost.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when the signal lands. When that is a
``__del__`` method or a weakref callback (garbage collection runs them at arbitrary points, e.g. inside the
tokenizer's regex objects), Python prints "Exception ignored" and carries on: a calibration run that was asked to
stop would finish and publish its artifact. So the handler here also *remembers* the signal, and

* an unraisable-exception hook re-delivers a swallowed interrupt to the main thread, so it lands again at the
  next ordinary line;
* :func:`check` raises it at the points that matter (every progress tick, and just before an artifact is
  renamed into place), so nothing is published after a stop was asked for, whatever a library swallowed;
* :func:`deferred` holds them across a step a signal must not split (an artifact renamed into place, the old one
  removed, a temporary folder removed): the step finishes, then the stop is raised, so what the message after it
  says is what is on disk;
* :func:`settle` ignores further signals once cleanup is done, so a re-delivered copy cannot turn the documented
  exit code 130 into death by signal.

Both signals raise ``KeyboardInterrupt`` (a ``BaseException``), which ``except Exception`` in library code
does not catch, and every ``with`` block unwinds on the way out.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: int | None = None
_holding = 0  # how many deferred() blocks the main thread is in
_held: int | None = None  # a signal that arrived inside them, raised when the outermost one ends
_default_unraisablehook = sys.unraisablehook


class Stopped(KeyboardInterrupt):
    """The interrupt, naming the signal that asked for it."""

    def __init__(self, signum: int, when: str = "") -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}{f' {when}' if when else ''}")
        self.signum = signum


def _on_signal(signum: int, frame: Any) -> None:
    global _received, _held
    _received = signum
    if _holding:
        _held = signum
        return
    raise Stopped(signum)


def _redeliver(signum: int) -> None:
    time.sleep(0.05)
    _thread.interrupt_main(signum)


def _unraisable(args: Any) -> None:
    if _received is not None and isinstance(args.exc_value, KeyboardInterrupt):
        # From another thread, a moment later, so the signal lands after this hook returns rather than inside it
        # (``threading.Thread.start`` would wait for the thread, and the signal would land in that wait).
        _thread.start_new_thread(_redeliver, (_received,))
        return
    _default_unraisablehook(args)


def install() -> None:
    """Route SIGINT and SIGTERM through :func:`_on_signal` (main thread only: Python allows no other)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    sys.unraisablehook = _unraisable


def check() -> None:
    """Raise the interrupt again if one arrived and something swallowed it."""
    if _received is not None:
        raise Stopped(_received)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block is done, then raise :class:`Stopped` for one that arrived meanwhile
    (not when the block raised: its exception goes on, and the signal stays remembered for :func:`check`).

    For steps that must happen whole once begun: two renames that swap an artifact into place (split, the output
    path would hold neither artifact), removing a folder the message after the stop says was removed. Our handler
    is put in place for the block even where :func:`install` was not called (the API used as a library); signals
    already ignored (:func:`settle`) stay ignored. A no-op off the main thread, where no signal handler runs."""
    global _holding, _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in _SIGNALS}
    for s, handler in saved.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _on_signal)
    if not _holding:
        _held = None
    _holding += 1
    try:
        yield
    finally:
        _holding -= 1
        for s, handler in saved.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(s, handler)
    if not _holding and _held is not None:
        signum, _held = _held, None
        raise Stopped(signum)


def settle() -> None:
    """Ignore further SIGINT/SIGTERM: cleanup is done and the process is about to exit with code 130."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
