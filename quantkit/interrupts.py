"""Ctrl-C and SIGTERM that are never lost.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when the signal lands. When that is a
``__del__`` method or a weakref callback (garbage collection runs them at arbitrary points, e.g. inside the
tokenizer's regex objects), Python prints "Exception ignored" and carries on: a calibration run that was asked to
stop would finish and publish its artifact. So the handler here also *remembers* the signal, and

* an unraisable-exception hook re-delivers a swallowed interrupt to the main thread, so it lands again at the
  next ordinary line;
* :func:`check` raises it at the points that matter (every progress tick, and just before an artifact is
  renamed into place), so nothing is published after a stop was asked for, whatever a library swallowed;
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
from typing import Any

_received: int | None = None
_default_unraisablehook = sys.unraisablehook


class Stopped(KeyboardInterrupt):
    """The interrupt, naming the signal that asked for it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _on_signal(signum: int, frame: Any) -> None:
    global _received
    _received = signum
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


def settle() -> None:
    """Ignore further SIGINT/SIGTERM: cleanup is done and the process is about to exit with code 130."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
