"""Human output: Rich progress bars and spinners for long steps, timings per step, and quiet/JSON modes.

Everything a person reads goes through a :class:`Reporter`. With ``--json`` it writes to stderr so stdout
carries only the machine-readable result; with ``--quiet`` it shows nothing but errors. The figures in what a person
reads (a table, a summary, an error's sizes) are written one way everywhere: :func:`fmt_num`, :func:`fmt_bytes`.

Libraries draw their own tqdm bars (compressed-tensors' "Applying quantization config" and "Dispatching model",
llm-compressor's per-layer "Calibrating"): they ignore ``--quiet`` and break Rich's live display, and some pass
``disable=False`` explicitly, which overrides ``TQDM_DISABLE``. :func:`silence_library_bars` turns every tqdm bar
off for the process (the CLI does it unless ``--debug``), and forwards llm-compressor's per-layer bars to
:meth:`Reporter.layers`, so the quantize step shows layer i of n with the time left instead of a spinner.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from quantkit import interrupts


# llm-compressor's sequential pipeline names each layer's bars "(3/9): Calibrating", "(3/9): Propagating".
_LAYER = re.compile(r"^\((\d+)/(\d+)\): (\w+)")
_layer_sink: list[Callable[[int, int, str], None]] = []
_silenced = False
SAY_EVERY_S = 15.0  # a wait's plain status line, where no live display can be drawn (a log, a CI capture)
_command: list["Reporter"] = []


def silence_library_bars() -> None:
    """Turn off every tqdm bar in this process, forwarding per-layer ones to an active :meth:`Reporter.layers`."""
    global _silenced
    if _silenced:
        return
    import tqdm.std

    original = tqdm.std.tqdm.__init__

    def quiet_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        original(self, *args, **kwargs)
        desc = kwargs.get("desc", args[1] if len(args) > 1 else None)
        if _layer_sink and isinstance(desc, str) and (m := _LAYER.match(desc)):
            _layer_sink[-1](int(m.group(1)), int(m.group(2)), m.group(3))

    tqdm.std.tqdm.__init__ = quiet_init  # type: ignore[method-assign]
    _silenced = True


class _Progress(Progress):
    """Rich's Progress, less the empty line it prints when it stops on a console that is not interactive (a log, a CI
    capture, stderr under ``--json``): a run's output started with one, and had one before every step's line. A
    bar that is not transient still gets its line ended: its last state is printed without a newline."""

    def stop(self) -> None:
        if self.disable:
            return
        self.live.stop()
        if not self.live.transient and not self.console.is_interactive and not self.console.is_jupyter:
            self.console.print()


class _Task:
    """A handle on one progress bar: ``advance(n)`` and ``update(description=..)``."""

    def __init__(self, progress: Progress | None, task_id: Any) -> None:
        self._p, self._id = progress, task_id

    def advance(self, n: float = 1) -> None:
        interrupts.check()
        if self._p is not None:
            self._p.advance(self._id, n)

    def update(self, **kw: Any) -> None:
        if self._p is not None:
            self._p.update(self._id, **kw)


class Reporter:
    """Progress, status and timing for one command."""

    def __init__(self, console: Console | None = None, *, quiet: bool = False) -> None:
        self.console = console or Console(stderr=True)
        self.quiet = quiet
        self.timings: dict[str, float] = {}
        self._said: set[str] = set()

    def log(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message)

    def warn(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/] {message}")

    def warn_once(self, message: str) -> None:
        """:meth:`warn`, once per command: a warning about an input several steps read (``quantkit run``'s outputs
        on one calibration set) is said the first time only."""
        if message not in self._said:
            self._said.add(message)
            self.warn(message)

    @contextmanager
    def step(self, key: str, description: str) -> Iterator[None]:
        """An opaque step (a library call we cannot see inside): a spinner with elapsed time; timed as ``key``."""
        if self.quiet:
            with self.timed(key):
                yield
            return
        with self.timed(key), _Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                       console=self.console, transient=True) as p:
            p.add_task(description, total=None)
            yield
        self._done(key, description)

    @contextmanager
    def layers(self, key: str, description: str) -> Iterator[None]:
        """A library call that works layer by layer (llm-compressor's sequential pipeline): a bar of layers with
        the time left, fed by the library's own per-layer tqdm bars (see :func:`silence_library_bars`); a
        spinner until the first layer starts, and for calls that report no layers. Timed as ``key``."""
        if self.quiet:
            with self.timed(key):
                yield
            return
        cols = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("layers"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn()]
        with self.timed(key), _Progress(*cols, console=self.console, transient=True) as p:
            tid = p.add_task(description, total=None)

            def on_layer(index: int, total: int, stage: str) -> None:
                interrupts.check()
                p.update(tid, total=total, completed=index - 1, description=f"{description} [dim]({stage})[/]")

            _layer_sink.append(on_layer)
            try:
                yield
            finally:
                _layer_sink.remove(on_layer)
        self._done(key, description)

    def _done(self, key: str, description: str) -> None:
        interrupts.check()  # a library call may have swallowed a Ctrl-C: do not report the step as done
        self.console.print(f"[green]✓[/] {description} [dim]({self.timings[key]:.1f}s)[/]")

    @contextmanager
    def bar(self, description: str, total: float | None, unit: str = "") -> Iterator[_Task]:
        """A progress bar over a known amount of work (windows, tensors, bytes)."""
        if self.quiet:
            yield _Task(None, None)
            return
        cols = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TaskProgressColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
        if unit:
            cols.insert(-2, TextColumn("{task.fields[rate]}"))
        with _Progress(*cols, console=self.console, transient=False) as p:
            tid = p.add_task(description, total=total, rate="")
            yield _Task(p, tid)

    @contextmanager
    def waiting(self, description: str) -> Iterator[Callable[[str], None]]:
        """A wait on something outside quantkit (a server starting): yields ``say(status)``, called as often as the
        status changes. On a terminal the status is a live line; elsewhere (a pipe, ``--json``) it is printed on
        stderr when the wait starts and then every :data:`SAY_EVERY_S` seconds, so a log shows what a run waits
        on, and nothing stays silent for long."""
        if self.quiet:
            yield lambda status: None
            return
        if self.console.is_terminal:
            with _Progress(SpinnerColumn(), TextColumn("{task.description}"), console=self.console,
                          transient=True) as p:
                tid = p.add_task(escape(description), total=None)
                yield lambda status: p.update(tid, description=escape(status))
            return
        plain = self.console if self.console.stderr else Console(stderr=True, highlight=False)
        said = [0.0]

        def say(status: str) -> None:
            now = time.monotonic()
            if not said[0] or now - said[0] >= SAY_EVERY_S:
                said[0] = now
                plain.print(status, markup=False, soft_wrap=True)

        yield say

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Time a step without showing anything (for steps that draw their own bars)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[key] = round(self.timings.get(key, 0.0) + time.perf_counter() - start, 3)


def use(reporter: Reporter) -> Reporter:
    """Make ``reporter`` the running command's (the CLI does, once per command), for code below an API that takes
    no reporter and still must not wait silently: an evaluation engine starting its server."""
    _command[:] = [reporter]
    return reporter


def command_reporter() -> Reporter:
    """The running command's reporter (:func:`use`), else a quiet one (the Python API, tests)."""
    return _command[-1] if _command else Reporter(quiet=True)


def fmt_num(v: Any, digits: int = 3) -> str:
    """A figure for a table: fixed digits, or '-' when there is none."""
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else "-"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
